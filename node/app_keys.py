"""Keys of the engine node's aiohttp app that other packages use (torch-free: `deploy.serve` reads
them in the router process too)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

# Functions whose maps join the node's /health answer (e.g. the prefill node's lease counts).
HEALTH_EXTRAS: web.AppKey[list[Callable[[], dict[str, Any]]]] = web.AppKey("health_extras", list)
# ``await app[DRAIN](timeout_s)`` before the app's cleanup on a planned stop (`deploy.serve`).
DRAIN: web.AppKey[Callable[[float], Awaitable[None]]] = web.AppKey("drain", object)

# ``app[ENGINE_STALLED](reason)`` once the node gave its stuck engine up (`node.app.EngineNode`): `deploy.serve`
# exits the process there (nothing else can end a thread stuck in a step). Unset: the node stays, answering 503.
ENGINE_STALLED: web.AppKey[Callable[[str], None]] = web.AppKey("engine_stalled", object)


class Drainable(Protocol):
    """Work a stopping node lets finish before it stops, beyond its admitted requests (the prefill
    node's KV leases, which decode nodes may still be reading)."""

    def pending(self) -> int:
        """How much is still outstanding (0: nothing to wait for)."""

    async def end(self) -> int:
        """End what is still outstanding when the drain's time is up; returns how much that was."""


# What `node.app.EngineNode.drain` waits for and then ends (see `Drainable`).
DRAINABLES: web.AppKey[list[Drainable]] = web.AppKey("drainables", list)
