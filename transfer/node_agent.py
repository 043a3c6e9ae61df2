"""An engine node's link to the transfer layer: its one NIXL agent, the address peers reach it by,
and pool calls that run on the engine's thread (the pool's one owner). Used by `prefill.kv_publish`
and `decode.kv_pull`; the engine itself never imports the transfer layer."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvrelay.transfer.nixl_agent import KvAgent
from kvrelay.transfer.pool_call import PoolCalls

if TYPE_CHECKING:  # types only: transfer/ does not need engine/ at run time
    from kvrelay.engine.engine import LLMEngine
    from kvrelay.engine.worker import EngineWorker


def advertised_host(bind: str) -> str:
    """The name peers reach this node by: the bind address, or this host's name when bound to all."""
    if bind in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface whose (primary IPv4) address is ``ip``, or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def restrict_transfer_to(bind: str, environ: dict[str, str] | None = None) -> str | None:
    """Keep NIXL's UCX transport on the interface of ``internal.bind`` (UCX's TCP transport otherwise
    listens on every interface): sets ``UCX_NET_DEVICES`` before the agent is made, unless the operator
    set it (RDMA clusters name their HCAs there). Returns the device list set, or None (bound to all
    addresses, already set, or no interface has that address)."""
    env = os.environ if environ is None else environ
    if "UCX_NET_DEVICES" in env or bind in ("0.0.0.0", "::", ""):
        return None
    device = "lo" if bind == "localhost" or bind.startswith("127.") else interface_of(bind)
    if device is None:
        return None
    env["UCX_NET_DEVICES"] = device
    return device


def worker_pool_calls(worker: EngineWorker) -> PoolCalls:
    """`transfer.pool_call.PoolCalls` that run on ``worker``'s engine thread (the pool's one owner)."""

    async def call(fn: Callable[[], Any]) -> Any:
        return await worker.call(lambda _engine: fn())

    async def must_run(fn: Callable[[], Any]) -> Any:
        return await worker.must_run(lambda _engine: fn())

    return PoolCalls(call, must_run)


def make_agent(engine: LLMEngine, name: str) -> KvAgent:
    """The node's one agent: the device pool (what peers read) and the host pool registered, and the
    store's device<->host moves sent through it as loopback transfers."""
    tiers = [("device", engine.kv_pool)]
    if engine.store.host is not None:
        tiers.append(("host", engine.store.host.pool))
    agent = KvAgent(name, engine.spec, tiers)
    engine.store.attach_local_copy(agent.local_copy)
    return agent
