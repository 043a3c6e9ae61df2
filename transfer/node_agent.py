"""An engine node's link to the transfer layer: its one NIXL agent, the address peers reach it by,
and pool calls that run on the engine's thread (the pool's one owner). Used by `prefill.kv_publish`
and `decode.kv_pull`; the engine itself never imports the transfer layer."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from transfer.nixl_agent import KvAgent

if TYPE_CHECKING:  # types only: transfer/ does not need engine/ at run time
    from engine.engine import LLMEngine
    from engine.worker import EngineWorker


def advertised_host(bind: str) -> str:
    """The name peers reach this node by: the bind address, or this host's name when bound to all."""
    if bind in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind


def worker_pool_call(worker: EngineWorker) -> Callable[[Callable[[], Any]], Awaitable[Any]]:
    """A `transfer.pool_call.PoolCall` that runs on ``worker``'s engine thread (the pool's one owner)."""

    async def call(fn: Callable[[], Any]) -> Any:
        return await worker.call(lambda _engine: fn())

    return call


def make_agent(engine: LLMEngine, name: str) -> KvAgent:
    """The node's one agent: the device pool (what peers read) and the host pool registered, and the
    store's device<->host moves sent through it as loopback transfers."""
    tiers = [("device", engine.kv_pool)]
    if engine.store.host is not None:
        tiers.append(("host", engine.store.host.pool))
    agent = KvAgent(name, engine.spec, tiers)
    engine.store.attach_local_copy(agent.local_copy)
    return agent
