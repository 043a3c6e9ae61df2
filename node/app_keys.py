"""Keys of the engine node's aiohttp app that other packages use (torch-free: `deploy.serve` reads
them in the router process too)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

# Functions whose maps join the node's /health answer (e.g. the prefill node's lease counts).
HEALTH_EXTRAS: web.AppKey[list[Callable[[], dict[str, Any]]]] = web.AppKey("health_extras", list)
# ``await app[DRAIN](timeout_s)`` before the app's cleanup on a planned stop (`deploy.serve`).
DRAIN: web.AppKey[Callable[[float], Awaitable[None]]] = web.AppKey("drain", object)
