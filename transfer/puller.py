"""`Puller`: the reader side of a KV transfer — pull a handle's blocks into the local device pool.

::

    pull(handle, deadline_s)
      0 check the handle alone: tokens per block; digests present if this node checks integrity
        (else raise "bad_handle" before any contact: the lease stays open for the forwarder)
      1 link = PeerCache.link(handle)                    handshake on first contact (bounded)
      2 reserve (on the pool's thread):  keys held locally → acquire;  missing → allocate
        (a handle naming blocks the owner lacks, or too few free blocks: notify "abort", raise)
      3 nothing missing?  notify "done" → return
      4 renew the lease now, then every ttl/3, over HTTP, naming the handle's binding; wait for the first
        answer: the owner confirms it leased exactly these block ids and digests for these keys under
        this lease (409 → "bad_handle": notify "abort", raise; not a byte was read)
      5 one NIXL READ per remote tier for the missing blocks, posted on the nixl thread
      6 poll from asyncio (200 µs → 5 ms backoff) until every READ is DONE, one is ERR, or the deadline
      7 confirm the lease was held when the READ completed (a renew sent before completion that
        returned ttl covers it), so the bytes are the ones the owner pinned
      8 release the READs and notify "done" (the owner unpins); check the read blocks against the
        handle's digests (`kvstore.digest`); key the blocks before the first mismatch → PullResult

The binding (step 4). NIXL READs are one-sided: the owner cannot refuse one, and a range check cannot tell a
block leased for a key from any other block of the owner's pool. So the reader reads nothing until the owner
has confirmed the handle's `KvHandle.binding` (`transfer.handle`): a handle for one prompt that names another
prompt's blocks, with or without digests that look right, is refused and nothing is read or keyed. It costs
the first renew's round trip before the READ (it used to overlap it).

Integrity. With a ``store`` whose ``integrity`` is on, a handle must carry digests (one per block; step 0),
and the blocks read are hashed where they landed (all of them under ``all``; under ``sampled`` each with
probability ``sample_rate``, so a damaged block goes unseen with ``1 - sample_rate``). A mismatch is a miss,
not an error: that block and every block after it go back to the pool unkeyed (held ones lose the pull's
reference), the failures are counted (``kvrelay_kv_integrity_failures_total{where="nixl_read"}``) and logged,
and the pull returns the verified prefix, so the engine computes the rest.

Failure (read error, timeout, vanished or restarted owner, lost lease, cancellation) raises one
`TransferError` after: released handles of finished READs, blocks held for keys back to the pool,
blocks whose READ finished (any outcome) back to the pool unkeyed, an "abort" notification to the owner.

The lease. Once a pull has reached the owner (step 1), every outcome tells it: "done" or "abort", and
`PullResult.lease_ended` / `TransferError.lease_ended` say whether that notification went out. A pull
that failed before (the quarantine cap, the handshake) or whose notification could not be sent leaves
the lease open: whoever forwarded the handle releases it (`transfer.config.LEASE_HEADER`).

Quarantine. NIXL may still write into the destination blocks of a READ that has not finished: with
UCX the bytes of a stalled READ were seen landing before it reported DONE, and even after its handle
was released and the peer removed. So a READ still in flight when the pull gives up keeps its blocks
out of the pool (``in use``, unkeyed, never handed out) and its handle alive; a background task polls
it and returns the blocks once NIXL reports DONE or ERR (a late completion is thus ignored: its bytes
are never keyed or used). If the peer stays stalled the blocks stay quarantined until it dies (UCX then
reports an error) or the agent is torn down. `pull` refuses new work beyond
``config.max_quarantined_blocks`` quarantined blocks.

A pull that finds the owner's connection dead (``peer_gone``: NIXL reports a disconnect, or the owner's
HTTP port refuses or drops the renewal) first removes the peer from the agent, which ends every READ
from it with an error, so its blocks are back in the pool when the error is raised. (Over UCX's TCP
transport a removed peer's bytes were seen landing later; that is accepted only for a dead connection.)
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Protocol

from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.kvstore.digest import IntegrityPolicy
from kvrelay.transfer.config import TransferConfig
from kvrelay.transfer.errors import TransferError
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.lease_keeper import LeaseKeeper
from kvrelay.transfer.nixl_agent import KvAgent, PeerLink, XferRequest
from kvrelay.transfer.peer_cache import PeerCache
from kvrelay.transfer.pool_call import INLINE, PoolCalls
from kvrelay.transfer.wire import encode_notif

log = logging.getLogger(__name__)
POLL_MIN_S = 0.0002
POLL_MAX_S = 0.005
QUARANTINE_POLL_MIN_S = 0.01
QUARANTINE_POLL_MAX_S = 0.1


@dataclass(frozen=True, slots=True)
class PullResult:
    """A completed pull.

    ``block_ids[i]`` is the local device block holding ``handle.keys[i]``, for the leading blocks that passed
    their checks (all of them unless ``num_bad``); the caller holds one reference on each and releases it
    (`BlockPool.release`) or hands it over (the engine's ``pinned_block_ids``).
    """

    block_ids: list[int]
    num_read: int
    num_held: int
    bytes_read: int
    elapsed_s: float
    num_bad: int = 0  # read blocks whose digest did not match (dropped with every block after the first)
    lease_ended: bool = False  # the owner was told "done" (its lease is over)
    num_checked: int = 0  # read blocks whose digest was checked (all, a sample, or none: `IntegrityPolicy`)


class IntegrityChecker(Protocol):
    """What the puller needs to check blocks (`kvstore.tiered_store.TieredStore` has it)."""

    integrity: IntegrityPolicy

    def digest_device_blocks(self, block_ids: list[int], keys: list[BlockKey]) -> list[int]: ...

    def integrity_failure(self, where: str, key: BlockKey, detail: str, num_blocks: int = 1) -> None: ...

    def integrity_checked(self, where: str, num_blocks: int) -> None: ...


@dataclass(frozen=True, slots=True)
class _Reservation:
    block_ids: list[int]
    missing: list[int]  # indices into the handle's keys that must be read
    held: list[int]  # indices already in the pool (acquired)


@dataclass(eq=False)
class _Quarantined:
    xfers: list[XferRequest]
    block_ids: list[int]


class Puller:
    """Pulls KV handles into ``pool`` (the device tier registered in ``agent`` as ``local_tier``).

    Args:
        agent: this node's agent; its ``local_tier`` pool tensor backs ``pool``.
        pool: the device `BlockPool`; mutated only through ``pool_calls``.
        peers: the handshake cache (also renews leases).
        config: ``renew_timeout_s``, ``max_quarantined_blocks``.
        pool_calls: run pool operations where the pool lives (`transfer.pool_call`): reserving blocks by
            ``call``; giving them back, and keying the blocks read, by ``must_run``.
        store: checks read blocks against the handle's digests (None: no check).
    """

    def __init__(
        self, agent: KvAgent, pool: BlockPool, peers: PeerCache, *, config: TransferConfig,
        pool_calls: PoolCalls = INLINE, store: IntegrityChecker | None = None,
    ) -> None:
        self._agent = agent
        self._pool = pool
        self._peers = peers
        self._config = config
        self._pool_calls = pool_calls
        self._store = store
        self._rng = random.Random()
        self.local_tier = "device"
        if agent.pool(self.local_tier).shape[0] != pool.num_blocks:
            raise ValueError(f"pool has {pool.num_blocks} blocks, agent tier 'device' "
                             f"{agent.pool(self.local_tier).shape[0]}")
        # Owned by Puller alone (event loop thread).
        self._quarantined: list[_Quarantined] = []
        self._drain_task: asyncio.Task[None] | None = None
        self.num_reads_in_flight = 0  # pulls with a posted READ not yet finished or abandoned

    # ------------------------------------------------------------ queries
    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(q.block_ids) for q in self._quarantined)

    def check_integrity(self) -> None:
        """Assert quarantined blocks are distinct, unkeyed and in use. Run where the pool lives.

        Raises:
            AssertionError: naming the first inconsistent block.
        """
        seen: set[int] = set()
        for q in self._quarantined:
            for b in q.block_ids:
                assert b not in seen, f"block {b} is quarantined twice"
                seen.add(b)
                assert self._pool.ref_count(b) >= 1, f"quarantined block {b} is not in use"
                assert self._pool.key_of(b) is None, f"quarantined block {b} has a key"

    # --------------------------------------------------------------- pull
    async def pull(self, handle: KvHandle, *, deadline_s: float) -> PullResult:
        """Make every block of ``handle`` present in the local pool, reading only the missing ones.

        Returns:
            `PullResult`; its ``block_ids`` each carry one reference for the caller.

        Raises:
            TransferError: see `transfer.errors` for the reasons. No block of a failed pull is handed out,
                and by the time it is raised every block it reserved is back in the pool or quarantined.
            ValueError: ``deadline_s`` is not positive.
        """
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        t_end = t0 + deadline_s
        self._check_shape(handle)
        self._check_digests(handle)
        if self.num_quarantined_blocks > self._config.max_quarantined_blocks:
            raise TransferError("no_blocks", f"{self.num_quarantined_blocks} blocks are held back for reads from "
                                "stalled peers; refusing new pulls until they finish")
        link = await self._peers.link(handle, timeout_s=min(self._config.handshake_timeout_s, deadline_s))
        try:
            self._check_blocks(handle, link)
            res: _Reservation = await self._pool_calls.call(lambda: self._reserve(handle.keys))
        except TransferError as exc:
            exc.lease_ended = await self._notify(link, "abort", handle)
            raise
        if not res.missing:
            ended = await self._notify(link, "done", handle)
            return PullResult(res.block_ids, 0, len(res.held), 0, loop.time() - t0, lease_ended=ended)
        keeper = LeaseKeeper(self._peers, handle, renew_timeout_s=self._config.renew_timeout_s)
        xfers: list[XferRequest] = []
        try:
            await keeper.wait_confirmed(t_end)
            xfers = await self._agent.read(link, [handle.blocks[i] for i in res.missing], self.local_tier,
                                           [res.block_ids[i] for i in res.missing])
            self.num_reads_in_flight += 1
            t_done = await self._wait(xfers, handle, keeper, t_end)
            await keeper.wait_covers(t_done, t_end)
        except BaseException as exc:
            keeper.stop()
            cleanup = asyncio.ensure_future(self._abandon(link, handle, res, xfers, exc))
            await asyncio.shield(cleanup)  # a second cancellation leaves the clean-up running
            raise
        finally:
            if xfers:
                self.num_reads_in_flight -= 1
        keeper.stop()
        finish = asyncio.ensure_future(self._finish(link, handle, res, xfers))
        try:
            kept, num_bad, num_checked, ended = await asyncio.shield(finish)
        except asyncio.CancelledError:
            # The caller gave up after the bytes arrived: the blocks it would have kept go back to the pool
            # (a `_finish` that failed has given back all of them).
            finish.add_done_callback(lambda f: None if f.cancelled() or f.exception() else asyncio.ensure_future(
                self._pool_calls.must_run(lambda: self._pool.release(f.result()[0]))))
            raise
        return PullResult(kept, len(res.missing), len(res.held), sum(x.num_bytes for x in xfers),
                          loop.time() - t0, num_bad, lease_ended=ended, num_checked=num_checked)

    async def _finish(self, link: PeerLink, handle: KvHandle, res: _Reservation,
                      xfers: list[XferRequest]) -> tuple[list[int], int, int, bool]:
        """Complete the READs (notifying "done"), then check and key the blocks: (kept ids, bad blocks,
        checked blocks, whether the owner was told)."""
        try:
            told = await self._agent.complete(xfers, link.name, encode_notif("done", handle.lease_id))
            if not told:
                log.warning("could not tell %r that lease %s is done; it stays open for the router to release",
                            link.name, handle.lease_id)
        except Exception:  # noqa: BLE001 - the READs are over: their blocks go back unkeyed
            log.exception("completing the READs of lease %s failed", handle.lease_id)
            await self._pool_calls.must_run(lambda: self._pool.release(res.block_ids))
            raise TransferError("internal", "completing the READs failed; the blocks were given back") from None
        registered: list[list[int]] = []  # the kept ids, once `_register` ran

        def register() -> tuple[list[int], int, int]:
            kept, num_bad, num_checked = self._register(handle, res)
            registered.append(kept)
            return kept, num_bad, num_checked

        try:
            kept, num_bad, num_checked = await self._pool_calls.must_run(register)
        except TimeoutError:
            # `register` still runs when the engine thread is back; this runs after it (queue order) and
            # gives back what it kept, since nobody is left to take it.
            asyncio.ensure_future(self._pool_calls.must_run(
                lambda: self._pool.release(registered.pop() if registered else [])))
            raise TransferError("timeout", f"the engine thread did not key the {len(res.block_ids)} blocks read "
                                "in time (busy or stalled); they go back to the pool once it does") from None
        return kept, num_bad, num_checked, told

    def _check_shape(self, handle: KvHandle) -> None:
        expected = self._agent.spec.tokens_held(handle.num_blocks)
        if expected is None or handle.num_tokens != expected:
            raise TransferError("bad_handle", f"handle covers {handle.num_tokens} tokens with {handle.num_blocks} "
                                f"full blocks of {self._agent.spec.block_size_tokens}; expected {expected}")

    def _check_digests(self, handle: KvHandle) -> None:
        store = self._store
        if store is not None and store.integrity.enabled and not handle.digests:
            raise TransferError(
                "bad_handle", f"the KV handle from {handle.owner_agent!r} carries no block digests, but this node "
                f"checks KV integrity (kvstore.integrity: {store.integrity.mode}), so nothing it would read could be "
                "checked; run the prefill nodes with kvstore.integrity on too (sampled or all)")

    def _check_blocks(self, handle: KvHandle, link: PeerLink) -> None:
        for tier, block_id in handle.blocks:
            region = link.meta.tier(tier)
            if region is None:
                raise TransferError("bad_handle", f"handle names tier {tier!r}, which {link.name!r} does not "
                                    f"publish (it has {[t.name for t in link.meta.tiers]})")
            if not 0 <= block_id < region.num_blocks:
                raise TransferError("bad_handle", f"handle names {tier} block {block_id}; {link.name!r} has "
                                    f"{region.num_blocks}")

    def _reserve(self, keys: tuple[BlockKey, ...]) -> _Reservation:
        found = [self._pool.block_id_of(key) for key in keys]
        held = [i for i, b in enumerate(found) if b is not None]
        held_ids = [b for b in found if b is not None]
        self._pool.acquire(held_ids)  # before allocating, so allocation cannot evict them
        missing = [i for i, b in enumerate(found) if b is None]
        new = self._pool.try_allocate(len(missing))
        if new is None:
            self._pool.release(held_ids)
            raise TransferError("no_blocks", f"need {len(missing)} free KV blocks to pull into but only "
                                f"{self._pool.num_free_blocks} are free or evictable")
        block_ids = [b if b is not None else -1 for b in found]
        for i, b in zip(missing, new, strict=True):
            block_ids[i] = b
        return _Reservation(block_ids, missing, held)

    def _register(self, handle: KvHandle, res: _Reservation) -> tuple[list[int], int, int]:
        """Check the read blocks, key those before the first bad one and release the rest. Returns the
        kept block ids (a prefix of ``res.block_ids``), the number of bad blocks and of blocks checked. On the
        pool's thread."""
        keys = handle.keys
        store = self._store
        on = store is not None and store.integrity.enabled
        digests = handle.digests if on else ()  # integrity off here: nothing is checked or carried
        end, num_bad, num_checked = len(keys), 0, 0
        if store is not None and digests:  # on: `_check_digests` refused a handle without them
            picked = [res.missing[j] for j in store.integrity.pick(len(res.missing), self._rng)]
            try:
                got = store.digest_device_blocks([res.block_ids[i] for i in picked], [keys[i] for i in picked])
            except Exception as exc:  # noqa: BLE001 - nothing is keyed yet: give every block back
                self._pool.release(res.block_ids)
                raise TransferError("internal", f"digesting the blocks read failed: {exc}") from exc
            store.integrity_checked("nixl_read", len(picked))
            num_checked = len(picked)
            bad = [i for i, g in zip(picked, got, strict=True) if g != digests[i]]
            if bad:
                end, num_bad = bad[0], len(bad)
                store.integrity_failure(
                    "nixl_read", keys[end], f"{num_bad} of {len(picked)} blocks read from {handle.owner_agent!r} "
                    f"did not match their digests (blocks {bad[:8]}, keys {[keys[i].hex()[:16] for i in bad[:4]]}); "
                    f"keeping the first {end} of {len(keys)}", num_blocks=num_bad)
        for i in res.missing:
            if i < end:  # False: a concurrent pull keyed it first
                self._pool.register_key(res.block_ids[i], keys[i], digest=digests[i] if digests else None)
        self._pool.release(res.block_ids[end:])
        return res.block_ids[:end], num_bad, num_checked

    async def _wait(self, xfers: list[XferRequest], handle: KvHandle, keeper: LeaseKeeper, t_end: float) -> float:
        """Poll until every READ is DONE; returns the loop time it was seen. Raises TransferError."""
        loop = asyncio.get_running_loop()
        interval = POLL_MIN_S
        while True:
            if not all(x.finished for x in xfers):  # a same-host READ often finishes inside its post
                await self._agent.poll(xfers)
            failed = [x for x in xfers if x.state == "ERR"]
            if failed:
                gone = any(x.error in ("nixlRemoteDisconnectError", "nixlNotFoundError") for x in failed)
                raise TransferError(
                    "peer_gone" if gone else "read_error",
                    f"READ of {sum(len(x.local_ids) for x in xfers)} blocks from {handle.owner_agent!r} failed: "
                    f"{failed[0].error}")
            now = loop.time()
            if all(x.state == "DONE" for x in xfers):
                return now
            if keeper.failure is not None and keeper.failure.reason != "timeout":
                raise keeper.failure
            if now >= t_end:
                raise TransferError("timeout", f"READ of {sum(len(x.local_ids) for x in xfers)} blocks from "
                                    f"{handle.owner_agent!r} did not complete before the deadline")
            await asyncio.sleep(min(interval, t_end - now))
            interval = min(interval * 2, POLL_MAX_S)

    async def _notify(self, link: PeerLink, kind: str, handle: KvHandle) -> bool:
        """Tell the owner the lease is ``kind`` ("done" | "abort"); whether the notification went out."""
        if not await self._agent.send_notif(link.name, encode_notif(kind, handle.lease_id)):
            log.warning("could not tell %r that lease %s is %s; it stays open for the router to release",
                        link.name, handle.lease_id, kind)
            return False
        return True

    # ---------------------------------------------------------- failure
    async def _abandon(
        self, link: PeerLink, handle: KvHandle, res: _Reservation, xfers: list[XferRequest], exc: BaseException,
    ) -> None:
        gone = isinstance(exc, TransferError) and exc.reason == "peer_gone"
        if gone:
            # The owner's connection is dead: drop it, so NIXL ends its READs (ours and other pulls')
            # with an error now and their blocks come back, and the next pull handshakes again.
            await self._peers.forget(link)
        try:
            if xfers:
                await self._agent.poll(xfers)  # learn the final states (a completion may have raced)
                await self._agent.release(xfers)
        finally:
            in_flight = [x for x in xfers if not x.finished]
            stuck_ids = [b for x in in_flight for b in x.local_ids]
            stuck = set(stuck_ids)
            to_free = [b for b in res.block_ids if b not in stuck]
            await self._pool_calls.must_run(lambda: self._pool.release(to_free))
            if in_flight:
                self._quarantine(_Quarantined(in_flight, stuck_ids))
        reason = exc.reason if isinstance(exc, TransferError) else type(exc).__name__
        log.warning("pull from %r abandoned (%s): %d blocks freed, %d quarantined", handle.owner_agent, reason,
                    len(to_free), len(stuck_ids))
        if not gone and link.active and isinstance(exc, TransferError):
            exc.lease_ended = await self._notify(link, "abort", handle)
        elif not gone and link.active:
            await self._notify(link, "abort", handle)

    def _quarantine(self, q: _Quarantined) -> None:
        self._quarantined.append(q)
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.create_task(self._drain_quarantine())

    async def _drain_quarantine(self) -> None:
        interval = QUARANTINE_POLL_MIN_S
        while self._quarantined:
            await asyncio.sleep(interval)
            interval = min(interval * 2, QUARANTINE_POLL_MAX_S)
            try:
                await self._agent.poll([x for q in self._quarantined for x in q.xfers])
            except RuntimeError:  # the agent was closed: its READs can no longer land
                log.warning("agent closed with %d blocks quarantined", self.num_quarantined_blocks)
                return
            finished = [q for q in self._quarantined if all(x.finished for x in q.xfers)]
            for q in finished:
                self._quarantined.remove(q)
                await self._agent.release(q.xfers)
                await self._pool_calls.must_run(lambda q=q: self._pool.release(q.block_ids))
                log.info("late READ finished (%s); %d quarantined blocks back in the pool, bytes ignored",
                         ",".join(x.state for x in q.xfers), len(q.block_ids))

    async def wait_quarantine_drained(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every quarantined block to return; True if none is left."""
        task = self._drain_task
        if task is None or task.done():
            return not self._quarantined
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            pass
        return not self._quarantined

    async def aclose(self) -> None:
        """Stop polling quarantined READs (their blocks stay out of the pool; tear the agent down next)."""
        if self._drain_task is not None:
            self._drain_task.cancel()
            try:
                await self._drain_task
            except asyncio.CancelledError:
                pass
