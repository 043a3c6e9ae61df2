"""Publishing a prompt's KV: the prefill node's side of a transfer (compute → key → lease → handle).

`PrefillTransfer.publish` runs on the engine thread the moment a prompt finishes: it keys the prompt's
full blocks, pins them under a lease in the node's `transfer.owner.KvOwner` and returns the handle the
decode node will pull from; the owner serves ``/kv/meta``, renewals and the done/abort notifications.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from aiohttp import web
from kvrelay.engine.engine import LLMEngine
from kvrelay.engine.worker import EngineWorker
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.node.app_keys import DRAINABLES, HEALTH_EXTRAS
from kvrelay.transfer.config import TransferConfig
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.lease import LeaseTable, TierBlock
from kvrelay.transfer.node_agent import make_agent, worker_pool_calls
from kvrelay.transfer.owner import KvOwner
from kvrelay.transfer.server import add_transfer_routes


class PrefillTransfer:
    """Owner side: pins a finished prompt's blocks under a lease and serves ``/kv/meta`` and renewals."""

    def __init__(self, worker: EngineWorker, config: TransferConfig, *, owner_url: str) -> None:
        engine = worker.engine
        self.agent = make_agent(engine, config.agent_name)
        self.owner = KvOwner(self.agent, LeaseTable({"device": engine.pool}), owner_url=owner_url, config=config,
                             pool_calls=worker_pool_calls(worker))
        self.faults = config.inject_faults

    def publish(self, engine: LLMEngine, keys: list[BlockKey]) -> KvHandle | None:
        """On the engine thread, right after the prompt finished: lease the leading blocks of ``keys`` (the
        keys of the prompt's full blocks, computed once for the request) that the pool holds. None if none."""
        spec = engine.spec
        block_ids = engine.pool.match_prefix(keys)
        block_ids = block_ids[: len(block_ids) - len(block_ids) % spec.num_groups]  # whole 16-token blocks
        if not block_ids:
            return None
        digests = [engine.pool.digest_of(b) for b in block_ids]
        handle = self.owner.offer(keys[: len(block_ids)], [TierBlock("device", b) for b in block_ids],
                                  num_tokens=spec.tokens_held(len(block_ids)),
                                  digests=[] if None in digests else digests)  # type: ignore[arg-type]
        if self.faults:
            self._inject(engine, handle)
            handle = self._falsify(engine, handle)
        return handle

    def _falsify(self, engine: LLMEngine, handle: KvHandle) -> KvHandle:
        """Tests only (`transfer.config.HANDLE_FAULTS`): the handle as a broken owner might hand it out; its
        lease still pins the real blocks, and must not outlive the request that carried it."""
        if "handle_names_absent_blocks" in self.faults:
            handle = dataclasses.replace(handle, blocks=tuple(
                TierBlock(b.tier, b.block_id + engine.pool.num_blocks) for b in handle.blocks))
        if "handle_with_other_keys" in self.faults:
            handle = dataclasses.replace(handle, keys=tuple(
                BlockKey(hashlib.sha256(b"other" + k).digest()) for k in handle.keys))
        if "malformed_handle" in self.faults:
            handle = dataclasses.replace(handle, num_tokens=0)  # no handle covers 0 tokens: it does not parse
        return handle

    def _inject(self, engine: LLMEngine, handle: KvHandle) -> None:
        """Tests only (`transfer.config.PUBLISH_FAULTS`): damage the blocks just offered, which the reader
        must catch by their digests. The handle and the lease are left as they are."""
        pool = engine.kv_pool
        rows = pool.view(pool.shape[0], -1).view(torch.uint8)
        ids = [b.block_id for b in handle.blocks]
        if "corrupt_published_block" in self.faults:  # the top exponent bit of one value (little endian)
            rows[ids[-1], rows.shape[1] // 2 + pool.element_size() - 1] ^= 0x40
        if "overwrite_leased_blocks" in self.faults:
            rows[ids] = torch.randint(0, 256, (len(ids), rows.shape[1]), dtype=torch.uint8, device=rows.device)

    async def release(self, handle: KvHandle) -> None:
        await self.owner.release(handle.lease_id)

    def install(self, app: web.Application) -> None:
        add_transfer_routes(app, self.owner)
        app.setdefault(HEALTH_EXTRAS, []).append(self._health)
        app.setdefault(DRAINABLES, []).append(self)
        app.on_cleanup.append(self._close)

    def pending(self) -> int:
        """Leases outstanding: a stopping node waits for decode nodes to finish reading them."""
        return self.owner.leases.num_leases

    async def end(self) -> int:
        """Release every lease left (the node is stopping); returns how many there were."""
        return await self.owner.release_all()

    def _health(self) -> dict[str, int]:
        return {"leases": self.owner.leases.num_leases, "leased_blocks": self.owner.leases.num_pinned_blocks}

    async def _close(self, app: web.Application) -> None:
        self.agent.close()
