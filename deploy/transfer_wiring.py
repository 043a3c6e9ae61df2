"""Connects a node's engine to the transfer layer: its NIXL agent, the prefill side's lease owner and
the decode side's puller. Pool operations of the transfer layer run on the engine's worker thread."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from engine.engine import LLMEngine
from engine.worker import EngineWorker
from kvstore.block_key import block_keys
from transfer.config import TransferConfig
from transfer.errors import TransferError
from transfer.lease import LeaseTable, TierBlock
from transfer.nixl_agent import KvAgent
from transfer.owner import KvOwner
from transfer.peer_cache import PeerCache
from transfer.puller import Puller, PullResult
from transfer.server import add_transfer_routes
from transfer.wire import WireError, handle_from_wire, handle_to_wire


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


class PrefillTransfer:
    """Owner side: pins a finished prompt's blocks under a lease and serves ``/kv/meta`` and renewals."""

    def __init__(self, worker: EngineWorker, config: TransferConfig, *, owner_url: str) -> None:
        engine = worker.engine
        self.agent = make_agent(engine, config.agent_name)
        self.owner = KvOwner(self.agent, LeaseTable({"device": engine.pool}), owner_url=owner_url, config=config,
                             pool_call=worker_pool_call(worker))

    def publish(self, engine: LLMEngine, prompt: list[int], salt: bytes) -> dict[str, Any] | None:
        """On the engine thread, right after the prompt finished: lease its full blocks. None if it has none."""
        spec = engine.spec
        keys = block_keys(prompt, block_size_tokens=spec.block_size_tokens, spec_fingerprint=spec.fingerprint,
                          salt=salt)
        block_ids = engine.pool.match_prefix(keys)
        if not block_ids:
            return None
        handle = self.owner.offer(keys[: len(block_ids)], [TierBlock("device", b) for b in block_ids],
                                  num_tokens=len(block_ids) * spec.block_size_tokens)
        return handle_to_wire(handle)

    async def release(self, handle: dict[str, Any]) -> None:
        await self.owner.release(handle_from_wire(handle).lease_id)

    def install(self, app: web.Application) -> None:
        add_transfer_routes(app, self.owner)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        self.agent.close()


class DecodeTransfer:
    """Reader side: pulls a handle's missing blocks into the engine's pool over NIXL."""

    def __init__(self, worker: EngineWorker, config: TransferConfig) -> None:
        self.worker = worker
        self.config = config
        self.agent = make_agent(worker.engine, config.agent_name)
        self._session: aiohttp.ClientSession | None = None
        self._peers: PeerCache | None = None
        self._puller: Puller | None = None

    async def pull(self, handle: dict[str, Any], request_id: str, *, deadline_s: float) -> PullResult:
        """Pull the handle's blocks; their local ids carry one reference each, for the engine to take over.

        Raises:
            TransferError: the pull failed (``reason`` says why); a malformed handle is ``bad_handle``.
        """
        assert self._puller is not None, "DecodeTransfer.install() was not called"
        try:
            parsed = handle_from_wire(handle)
        except WireError as exc:
            raise TransferError("bad_handle", f"the KV handle is malformed: {exc}") from None
        return await self._puller.pull(parsed, deadline_s=deadline_s)

    def install(self, app: web.Application) -> None:
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession()
        self._peers = PeerCache(self.agent, self._session, config=self.config)
        self._puller = Puller(self.agent, self.worker.engine.pool, self._peers, config=self.config,
                              pool_call=worker_pool_call(self.worker))

    async def _close(self, app: web.Application) -> None:
        if self._puller is not None:
            await self._puller.aclose()
        if self._peers is not None:
            await self._peers.close()
        if self._session is not None:
            await self._session.close()
        self.agent.close()
