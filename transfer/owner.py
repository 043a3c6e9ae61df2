"""`KvOwner`: the owner side of a KV transfer — hand out handles under leases, unpin when told or expired.

::

    offer(keys, blocks, num_tokens) ──▶ LeaseTable.grant ──▶ KvHandle (to the reader, via the router)
    reader's NIXL notification {"done"|"abort", lease_id} ──▶ drain_notifications ──▶ LeaseTable.release
    POST /kv/lease/renew {lease_id, binding}              ──▶ renew (refused for another binding)
    every reap_interval_s                                 ──▶ reap (expired leases unpin)

The reader READs the blocks one-sidedly; the owner does nothing per READ but keep them pinned. What it can
do is refuse to confirm a lease for a handle other than the one it built (`transfer.handle.binding_of`),
and the reader confirms before it reads (`transfer.puller`).
`run` drives the notification drain and the reaper until cancelled (`transfer.server` starts it).
With no lease outstanding there is nothing to drain or reap, so `run` sleeps until `offer` grants one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvrelay.kvstore.block_key import BlockKey
from kvrelay.transfer.config import TransferConfig
from kvrelay.transfer.handle import KvHandle, binding_of
from kvrelay.transfer.lease import LeaseTable, TierBlock
from kvrelay.transfer.nixl_agent import KvAgent
from kvrelay.transfer.pool_call import INLINE, PoolCalls
from kvrelay.transfer.wire import WireError, decode_notif

# A renewal of a lease with more than this left is answered on the event loop (`LeaseTable.renew_live`), not on the
# engine thread: there it waited for the step under way, up to a long prefill's (~1 s on one core), and a decode
# node's pull waits for two renewals (before and after its read). Measured on a 2-core machine, 1P1D at 2.5 long-mix
# req/s: the pull took 0.48 s median (p90 1.35 s) before, 0.034 s (p90 0.045 s) after.
LIVE_RENEW_MARGIN_S = 1.0

log = logging.getLogger(__name__)


class KvOwner:
    """Leases out blocks of ``agent``'s tiers to readers.

    Args:
        agent: this node's agent (its `meta` is what ``/kv/meta`` serves).
        leases: the lease table over this node's pools; changed only through ``pool_calls`` (or, for
            `offer`, by a caller already where the pools live), except a live lease's renewal
            (`LeaseTable.renew_live`, which changes no pool).
        owner_url: base URL readers reach this node's transfer endpoints at (goes into handles).
        config: ``lease_ttl_s``, ``reap_interval_s``, ``notif_poll_interval_s``, ``internal_token``.
        pool_calls: run lease operations where the pools live: other renewals by ``call``; releases and reaps,
            which unpin blocks, by ``must_run`` (they take effect even if their caller stopped waiting).
    """

    def __init__(
        self, agent: KvAgent, leases: LeaseTable, *, owner_url: str, config: TransferConfig,
        pool_calls: PoolCalls = INLINE,
    ) -> None:
        if not owner_url.startswith(("http://", "https://")):
            raise ValueError(f"owner_url must be an http(s) URL, got {owner_url!r}")
        self.agent = agent
        self.leases = leases
        self.owner_url = owner_url.rstrip("/")
        self.config = config
        self._pool_calls = pool_calls
        self.num_notifs = 0
        self.num_bad_notifs = 0
        self.num_reaped = 0
        self._wake: asyncio.Event | None = None  # set (from any thread) when a lease is granted; see `run`
        self._loop: asyncio.AbstractEventLoop | None = None

    def offer(self, keys: Sequence[BlockKey], blocks: Sequence[TierBlock], *, num_tokens: int,
              digests: Sequence[int] = ()) -> KvHandle:
        """Pin ``blocks`` (``blocks[i]`` holds ``keys[i]``, whose digest is ``digests[i]``; none when integrity
        is off) under a new lease and describe them to a reader.

        Call where the pools live (it mutates them). The blocks must be full, keyed and in use or cached.

        Raises:
            ValueError: lengths differ, nothing to offer, ``num_tokens`` is not ``len(keys)·block_size_tokens``,
                a tier is not readable by peers (not registered with NIXL), or `LeaseTable.grant` refuses.
        """
        if not keys or len(keys) != len(blocks):
            raise ValueError(f"offer needs one block per key, got {len(keys)} keys and {len(blocks)} blocks")
        if len(digests) not in (0, len(keys)):
            raise ValueError(f"offer needs no digest or one per key, got {len(digests)} for {len(keys)} keys")
        held = self.agent.spec.tokens_held(len(keys))
        if held is None or num_tokens != held:
            raise ValueError(f"{len(keys)} full blocks ({self.agent.spec.num_groups} per 16-token block) hold "
                             f"{held} tokens, not {num_tokens}")
        readable = {t.name for t in self.agent.meta.tiers}
        for tier, _ in blocks:
            if tier not in readable:
                raise ValueError(f"tier {tier!r} is not readable by peers (registered: {sorted(readable)})")
        blocks = [TierBlock(t, b) for t, b in blocks]
        lease_id = self.leases.grant(blocks, ttl_s=self.config.lease_ttl_s, binding=binding_of(keys, blocks, digests))
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        return KvHandle(
            owner_agent=self.agent.name, owner_incarnation=self.agent.incarnation, owner_url=self.owner_url,
            keys=tuple(keys), blocks=tuple(blocks), num_tokens=num_tokens,
            lease_id=lease_id, lease_ttl_s=self.config.lease_ttl_s, digests=tuple(digests),
        )

    async def renew(self, lease_id: str, binding: bytes) -> float | None:
        """Extend a lease for the handle whose binding is ``binding``; its ttl in seconds, or None if it is gone. A
        live one at once (`LIVE_RENEW_MARGIN_S`), any other on the engine thread (``pool_calls``).

        Raises:
            BindingMismatch: the lease was granted for another handle (`LeaseTable.renew`).
        """
        ttl = self.leases.renew_live(lease_id, binding=binding, margin_s=LIVE_RENEW_MARGIN_S)
        if ttl is not None:  # a live lease: answered at once, not after the engine thread's step under way
            return ttl
        return await self._pool_calls.call(lambda: self.leases.renew(lease_id, binding=binding))

    async def release(self, lease_id: str) -> bool:
        """Unpin a lease's blocks; whether it was still held. It takes effect even if the caller stops
        waiting (raises TimeoutError then: the engine thread is busy, and runs it when it is back)."""
        return await self._pool_calls.must_run(lambda: self.leases.release(lease_id))

    async def release_all(self) -> int:
        """Release every lease (the node is stopping); returns how many there were. A reader still
        reading gets an error and recomputes (or, after a read, finds the lease gone: harmless)."""
        return await self._pool_calls.must_run(self.leases.release_all)

    async def drain_notifications(self) -> int:
        """Apply the notifications received so far; returns how many leases they released.

        Malformed notifications are counted (``num_bad_notifs``), logged and dropped.
        """
        released = 0
        for sender, messages in (await self.agent.get_notifs()).items():
            for message in messages:
                self.num_notifs += 1
                try:
                    notif = decode_notif(message)
                except WireError as exc:
                    self.num_bad_notifs += 1
                    log.warning("dropped a malformed notification from %r: %s", str(sender)[:128], exc)
                    continue
                try:
                    if await self.release(notif.lease_id):
                        released += 1
                except TimeoutError:  # the release still runs, once the engine thread is back
                    log.warning("releasing lease %s waits for the engine thread", notif.lease_id)
        return released

    async def reap(self) -> list[str]:
        """Unpin expired leases; returns their ids."""
        expired: list[str] = await self._pool_calls.must_run(self.leases.reap)
        self.num_reaped += len(expired)
        for lease_id in expired:
            log.info("lease %s expired; its blocks are unpinned", lease_id)
        return expired

    async def run(self) -> None:
        """Drain notifications every ``notif_poll_interval_s`` and reap every ``reap_interval_s`` while a
        lease is outstanding; with none, wait for `offer` to grant one. Runs until cancelled."""
        loop = asyncio.get_running_loop()
        self._loop, self._wake = loop, asyncio.Event()
        next_reap = loop.time()
        while True:
            try:
                await self.drain_notifications()
                if loop.time() >= next_reap:
                    await self.reap()
                    next_reap = loop.time() + self.config.reap_interval_s
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep unpinning whatever one pass hit
                log.exception("transfer owner background pass failed")
            if self.leases.num_leases == 0:  # a lease granted after this check sets _wake
                self._wake.clear()
                if self.leases.num_leases == 0:
                    await self._wake.wait()
                    next_reap = loop.time() + self.config.reap_interval_s
                    continue
            await asyncio.sleep(self.config.notif_poll_interval_s)

    def check_integrity(self) -> None:
        """Lease integrity (run where the pools live). Raises AssertionError."""
        self.leases.check_integrity()
