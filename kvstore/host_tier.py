"""`HostTier`: the ``host`` tier — device's victim cache in pinned CPU memory.

One pool tensor ``[num_blocks, L, P, H, B, D]`` (same layout as the device pool, so block ``s`` is one
contiguous byte range NIXL can register), pinned when CUDA is available and plain otherwise, plus a
key → slot map kept in LRU order::

    _key_to_slot (OrderedDict):  LRU ─▶ key_a:3, key_b:0, key_c:5 ◀─ MRU
    _free_slots  (deque):        1, 2, 4, ...

``put`` into a full tier evicts the LRU key; ``on_evict(slot, key)`` runs first, while the slot still
holds the evicted block, so the owner can demote it to ``disk``.

Copies use ``non_blocking`` when the pool is pinned: on CUDA they are asynchronous on the current
stream and the caller orders CPU reads of a slot after them (`TieredStore` does, through
`BlockMover`). Not thread-safe: one thread (the engine's) calls it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np
import torch
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_mover import Block, copy_block, pool_rows
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.tier import TierStats

HostEvictHook = Callable[[int, BlockKey], None]


class HostTier:
    """``num_blocks`` slots of host memory with an LRU key index.

    Args:
        spec: block layout; every block put or read has ``spec.block_shape`` and ``spec.torch_dtype``.
        num_blocks: slots (> 0).
        on_evict: ``on_evict(slot, key)`` before the LRU key loses its slot to a `put`.

    Raises:
        ValueError: ``num_blocks`` is not positive.
    """

    name = "host"

    def __init__(self, spec: BlockSpec, num_blocks: int, *, on_evict: HostEvictHook | None = None,
                 honour_cold: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"host tier needs a positive number of blocks, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        pool = spec.new_pool(num_blocks)
        self.pinned = torch.cuda.is_available()  # pin_memory() raises without an accelerator
        self.pool = pool.pin_memory() if self.pinned else pool
        self.rows = pool_rows(self.pool)  # the same memory as [num_blocks, block_bytes] uint8 (numpy)
        self._on_evict = on_evict
        self._block_shape = spec.block_shape
        # How bytes move in and out of a slot: ``copy(dst, src)``. `TieredStore.attach_local_copy`
        # replaces it to send device<->host moves through the node's NIXL agent.
        self.copy: Callable[[Block, Block], None] = lambda dst, src: copy_block(dst, src, non_blocking=self.pinned)
        # Owned by HostTier alone.
        self._key_to_slot: OrderedDict[BlockKey, int] = OrderedDict()  # first = least recently used
        self._free_slots: deque[int] = deque(range(num_blocks))
        self._reserved: set[int] = set()  # slots lent out by `reserve`: no key, never evicted
        self._cold: set[BlockKey] = set()  # keys put cold and not read or touched since
        self._key_to_digest: dict[BlockKey, int] = {}  # the digest each block came with (`kvstore.digest`)
        self.honour_cold = honour_cold

    # ----------------------------------------------------------------- queries
    def block(self, slot: int) -> Block:
        """One slot: its bytes (a row of `rows`, cheapest on CPU), or with CUDA the pinned tensor view, so
        that copies from and to the GPU stay asynchronous."""
        return self.pool[slot] if self.pinned else self.rows[slot]

    def is_cold(self, key: BlockKey) -> bool:
        """Whether ``key`` was put cold and not read or touched since (valid in ``on_evict`` too)."""
        return key in self._cold

    def digest_of(self, key: BlockKey) -> int | None:
        """The digest ``key``'s block was put with (None: put without one, or not held)."""
        return self._key_to_digest.get(key)

    def slot_of(self, key: BlockKey) -> int | None:
        return self._key_to_slot.get(key)

    def contains(self, key: BlockKey) -> bool:
        return key in self._key_to_slot

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            if key not in self._key_to_slot:
                break
            n += 1
        return n

    def keys_lru_first(self) -> list[BlockKey]:
        """Held keys, least recently used first (the eviction order)."""
        return list(self._key_to_slot)

    def stats(self) -> TierStats:
        return TierStats(self.name, len(self._key_to_slot), self.num_blocks, self.spec.block_bytes)

    # --------------------------------------------------------------- mutations
    def put(self, key: BlockKey, src: Block, *, cold: bool = False, digest: int | None = None) -> bool:
        """Copy block ``src`` into a slot under ``key`` (evicting the LRU key when full). False only when
        every slot is reserved (`reserve`), so there is nothing to evict.

        A key already held only moves to most recently used; nothing is copied. ``cold`` (`kvstore.policy`):
        a new key enters at the least recently used end when ``honour_cold``, and is reported by `is_cold`.
        ``digest``: the block's digest, kept for checks when it is read back (`digest_of`).

        Raises:
            ValueError: ``src`` has the wrong shape or dtype (or, as bytes, the wrong size).
        """
        if key in self._key_to_slot:
            if not (cold and self.honour_cold):
                self.touch(key)
            return True
        self._check(src)
        slot = self._take_slot()
        if slot is None:
            return False
        self.copy(self.block(slot), src)
        self._key_to_slot[key] = slot
        if digest is not None:
            self._key_to_digest[key] = digest
        if cold:
            self._cold.add(key)
            if self.honour_cold:
                self._key_to_slot.move_to_end(key, last=False)
        return True

    def _take_slot(self) -> int | None:
        """A free slot, else the LRU key's (``on_evict`` first); None when every slot is reserved."""
        if self._free_slots:
            return self._free_slots.popleft()
        if not self._key_to_slot:
            return None
        victim, slot = self._key_to_slot.popitem(last=False)
        if self._on_evict is not None:
            self._on_evict(slot, victim)
        self._cold.discard(victim)
        self._key_to_digest.pop(victim, None)
        return slot

    def reserve(self, num: int) -> list[int] | None:
        """``num`` slots for a caller's private blocks (a long-context policy's offloaded KV), taken
        out of the LRU: free slots first, then the least recently used keys (``on_evict`` first).
        They hold no key and are never evicted until `unreserve`. None (nothing changed) when fewer
        than ``num`` slots are free or keyed."""
        if num > len(self._free_slots) + len(self._key_to_slot):
            return None
        slots = [self._take_slot() for _ in range(num)]
        self._reserved.update(slots)  # type: ignore[arg-type]
        return slots  # type: ignore[return-value]

    def unreserve(self, slots: Sequence[int]) -> None:
        """Give reserved slots back to the free list. Raises ValueError for a slot not reserved."""
        for slot in slots:
            if slot not in self._reserved:
                raise ValueError(f"host slot {slot} is not reserved")
            self._reserved.remove(slot)
            self._free_slots.append(slot)

    @property
    def num_free_slots(self) -> int:
        """Slots holding nothing (neither a key nor a reservation)."""
        return len(self._free_slots)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def get_into(self, key: BlockKey, dst: Block) -> bool:
        """Copy the block under ``key`` into block ``dst`` and mark it most recently used; False on a miss."""
        slot = self._key_to_slot.get(key)
        if slot is None:
            return False
        self.copy(dst, self.block(slot))
        self._key_to_slot.move_to_end(key)
        self._cold.discard(key)
        return True

    def _check(self, src: Block) -> None:
        if isinstance(src, np.ndarray):
            if src.nbytes != self.spec.block_bytes:
                raise ValueError(f"host tier block must be {self.spec.block_bytes} bytes, got {src.nbytes}")
        elif tuple(src.shape) != self._block_shape or src.dtype != self.spec.torch_dtype:
            raise ValueError(
                f"host tier block must be {self._block_shape} {self.spec.torch_dtype}, "
                f"got {tuple(src.shape)} {src.dtype}"
            )

    def touch(self, key: BlockKey) -> bool:
        if key not in self._key_to_slot:
            return False
        self._key_to_slot.move_to_end(key)
        self._cold.discard(key)
        return True

    def discard(self, key: BlockKey) -> bool:
        slot = self._key_to_slot.pop(key, None)
        if slot is None:
            return False
        self._cold.discard(key)
        self._key_to_digest.pop(key, None)
        self._free_slots.append(slot)
        return True

    # --------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert every slot is either free, held by exactly one key, or reserved.

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        held = list(self._key_to_slot.values()) + sorted(self._reserved)
        free = list(self._free_slots)
        assert len(set(held)) == len(held), "a host slot is held by two keys (or by a key and a reservation)"
        assert len(set(free)) == len(free), "a host slot is listed twice in the free list"
        assert not set(held) & set(free), f"host slots both held and free: {sorted(set(held) & set(free))}"
        assert len(held) + len(free) == self.num_blocks, (
            f"host: held {len(held)} + free {len(free)} != total {self.num_blocks}"
        )
        assert all(0 <= s < self.num_blocks for s in held + free), "host slot out of range"
        assert self._cold <= self._key_to_slot.keys(), "a host key is cold but not held"
        assert self._key_to_digest.keys() <= self._key_to_slot.keys(), "a host key has a digest but is not held"
