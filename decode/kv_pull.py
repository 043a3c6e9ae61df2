"""Pulling a prompt's KV: the decode node's side of a transfer (handle → verify → pull → join).

`DecodeTransfer.pull` lets the `transfer.puller.Puller` read
the missing blocks over NIXL into the engine's pool (pool operations on the engine thread); the
decode service hands the returned blocks to the engine with the request.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from kvrelay.engine.worker import EngineWorker
from kvrelay.transfer.config import TransferConfig, client_keepalive_s
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.node_agent import make_agent, worker_pool_calls
from kvrelay.transfer.peer_cache import PeerCache
from kvrelay.transfer.puller import Puller, PullResult


class DecodeTransfer:
    """Reader side: pulls a handle's missing blocks into the engine's pool over NIXL."""

    def __init__(self, worker: EngineWorker, config: TransferConfig) -> None:
        self.worker = worker
        self.config = config
        self.agent = make_agent(worker.engine, config.agent_name)
        self._session: aiohttp.ClientSession | None = None
        self._peers: PeerCache | None = None
        self._puller: Puller | None = None

    async def pull(self, handle: KvHandle, request_id: str, *, deadline_s: float) -> PullResult:
        """Pull the handle's blocks; their local ids carry one reference each, for the engine to take over.

        Raises:
            TransferError: the pull failed (``reason`` says why).
        """
        assert self._puller is not None, "DecodeTransfer.install() was not called"
        return await self._puller.pull(handle, deadline_s=deadline_s)

    def install(self, app: web.Application) -> None:
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)

    async def _start(self, app: web.Application) -> None:
        keepalive_s = client_keepalive_s(self.config.node_keepalive_s)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=keepalive_s))
        self._peers = PeerCache(self.agent, self._session, config=self.config)
        self._puller = Puller(self.agent, self.worker.engine.pool, self._peers, config=self.config,
                              pool_calls=worker_pool_calls(self.worker), store=self.worker.engine.store)

    async def _close(self, app: web.Application) -> None:
        if self._puller is not None:
            await self._puller.aclose()
        if self._peers is not None:
            await self._peers.close()
        if self._session is not None:
            await self._session.close()
        self.agent.close()
