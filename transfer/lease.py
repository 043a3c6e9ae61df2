"""`LeaseTable`: the owner's time-bounded pins of blocks for readers.

::

    grant(blocks, ttl_s, binding) ──▶ lease L: one ref on each block (BlockPool.acquire), expires at now + ttl_s
        │  renew(L, binding) expires_at = now + ttl_s again (a lease that has expired stays gone);
        │                    another binding than L's: BindingMismatch, nothing changes
        │  release(L)        one ref dropped from each block (BlockPool.release); idempotent
        └─ reap(now)         releases every lease with expires_at <= now

Leases never come back once released or expired, so a reader that confirms its lease after its READ
completed knows the blocks were pinned for the whole READ. A lease also keeps the ``binding`` of the
handle it was granted for (`transfer.handle.binding_of`: its keys, block ids and digests), so a reader that
confirms its lease knows its handle names exactly the blocks the owner pinned for those keys.

Not thread-safe: it mutates the pools, so it runs where they live (see `transfer.pool_call`); only `renew_live`,
which changes no pool and takes no lease away, may run on another thread beside it (the owner's event loop).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class TierBlock(NamedTuple):
    """A block on one tier of its owner: ``("device", 17)``."""

    tier: str
    block_id: int


class Pinnable(Protocol):
    """What a tier's pool offers for pinning (`kvstore.block_pool.BlockPool` has it)."""

    num_blocks: int

    def acquire(self, block_ids: Sequence[int]) -> None: ...

    def release(self, block_ids: Sequence[int]) -> None: ...

    def ref_count(self, block_id: int) -> int: ...


class BindingMismatch(ValueError):
    """A renewal named a live lease with a binding other than the one it was granted with: the reader's
    handle does not describe the blocks the lease pins for its keys."""


@dataclass(slots=True)
class Lease:
    lease_id: str
    blocks: tuple[TierBlock, ...]
    ttl_s: float
    expires_at: float  # clock() seconds
    binding: bytes  # `transfer.handle.binding_of` the handle the lease was granted for


class LeaseTable:
    """Leases over blocks of the pools in ``tier_to_pool``.

    Args:
        tier_to_pool: tier name → its pool (pins are `acquire`, unpins `release`).
        clock: monotonic seconds; injected by tests.
    """

    def __init__(self, tier_to_pool: Mapping[str, Pinnable], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._tier_to_pool = dict(tier_to_pool)
        self._clock = clock
        # Owned by LeaseTable alone.
        self._leases: dict[str, Lease] = {}

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_pinned_blocks(self) -> int:
        """Pins held, counting a block pinned by two leases twice."""
        return sum(len(lease.blocks) for lease in self._leases.values())

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def grant(self, blocks: Sequence[TierBlock], *, ttl_s: float, binding: bytes) -> str:
        """Pin ``blocks`` (one ref each) under a new lease for the handle whose binding is ``binding``; returns
        the lease's id (32 hex characters).

        Raises:
            ValueError: ``ttl_s`` is not positive, a tier is unknown, a block id is out of range, or a
                block is free (holds nothing); nothing is pinned then.
        """
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        blocks = tuple(TierBlock(tier, block_id) for tier, block_id in blocks)
        for tier, block_id in blocks:
            pool = self._tier_to_pool.get(tier)
            if pool is None:
                raise ValueError(f"no pool for tier {tier!r}; known: {sorted(self._tier_to_pool)}")
            if not 0 <= block_id < pool.num_blocks:
                raise ValueError(f"block {block_id} is out of range for tier {tier!r} ({pool.num_blocks} blocks)")
        pinned: list[TierBlock] = []
        try:
            for tier, block_id in blocks:
                self._tier_to_pool[tier].acquire([block_id])
                pinned.append(TierBlock(tier, block_id))
        except ValueError:
            self._unpin(pinned)
            raise
        lease_id = secrets.token_hex(16)
        self._leases[lease_id] = Lease(lease_id, blocks, float(ttl_s), self._clock() + ttl_s, bytes(binding))
        return lease_id

    def renew(self, lease_id: str, *, binding: bytes) -> float | None:
        """Extend a live lease to ``now + ttl_s``; returns that ttl, or None if the lease is gone.

        A lease past its expiry is reaped here rather than renewed.

        Raises:
            BindingMismatch: the lease is live but was granted for another ``binding`` (it is not extended;
                the reader is told to abort, or it expires).
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        now = self._clock()
        if lease.expires_at <= now:
            self.release(lease_id)
            return None
        if binding != lease.binding:
            raise BindingMismatch(f"lease {lease_id} pins other blocks for these keys: the handle's block ids or "
                                  "digests are not what the owner leased (altered on its way, or forged)")
        lease.expires_at = now + lease.ttl_s
        return lease.ttl_s

    def renew_live(self, lease_id: str, *, binding: bytes, margin_s: float) -> float | None:
        """`renew` where it changes no pool: extend a lease held with more than ``margin_s`` seconds left, granted
        for ``binding``, to ``now + ttl_s``; returns that ttl. None: not decided here (no such lease, one that
        expires within ``margin_s``, or another binding): call `renew` where the pools live.

        Safe on another thread than the one that releases and reaps (the owner's event loop, while the engine
        thread computes a long step): it only moves a live lease's expiry later. A `reap` could have listed the
        lease as expired only by reading its clock more than ``margin_s`` after this call read its own and before
        the new expiry was written, so a call that took longer than ``margin_s`` (a thread held off the CPU) reports
        nothing; nor does one whose lease was released meanwhile."""
        lease = self._leases.get(lease_id)
        if lease is None or binding != lease.binding:
            return None
        now = self._clock()
        if lease.expires_at - now <= margin_s:
            return None
        lease.expires_at = now + lease.ttl_s
        if self._clock() - now > margin_s or self._leases.get(lease_id) is not lease:
            return None
        return lease.ttl_s

    def release(self, lease_id: str) -> bool:
        """Unpin a lease's blocks. False (and nothing changes) if it was already released or reaped."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._unpin(lease.blocks)
        return True

    def reap(self, now: float | None = None) -> list[str]:
        """Release every lease that has expired by ``now`` (default: the clock); returns their ids."""
        now = self._clock() if now is None else now
        expired = [lease_id for lease_id, lease in self._leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self.release(lease_id)
        return expired

    def release_all(self) -> int:
        """Release every lease (shutdown); returns how many there were."""
        ids = list(self._leases)
        for lease_id in ids:
            self.release(lease_id)
        return len(ids)

    def _unpin(self, blocks: Sequence[TierBlock]) -> None:
        for tier, block_id in blocks:
            self._tier_to_pool[tier].release([block_id])

    def check_integrity(self) -> None:
        """Assert every pinned block holds at least as many refs as leases pin it.

        Raises:
            AssertionError: naming the first block with fewer refs than pins.
        """
        pins: dict[TierBlock, int] = {}
        for lease in self._leases.values():
            assert lease.ttl_s > 0, f"lease {lease.lease_id} has ttl {lease.ttl_s}"
            for block in lease.blocks:
                pins[block] = pins.get(block, 0) + 1
        for (tier, block_id), count in pins.items():
            refs = self._tier_to_pool[tier].ref_count(block_id)
            assert refs >= count, f"{tier} block {block_id} is pinned by {count} leases but has {refs} refs"
