"""`BlockPool`: allocation, ref counts and the prefix cache of the device tier.

A block is in exactly one state::

    free ──allocate──▶ in use (ref ≥ 1) ──release to ref 0──▶ cached (keyed) ──allocate (evict)──▶ in use
      ▲                       │                                   │
      └── release to ref 0 ───┘ (unkeyed)                         └─ acquire (prefix hit) ─▶ in use

* Only full blocks get keys (`register_key`); keyed blocks are immutable and shareable.
* Cached blocks form an LRU. `release` walks its argument back to front, so when a sequence
  releases its block table the tail block becomes the least recently used: a finished chain is
  evicted tail-first and its shared head survives longest.
* Allocation takes plain free blocks first and evicts cached blocks only when none are left.
* A keyed block carries its digest (`kvstore.digest`): given to `register_key` when the bytes came
  with one (a verified pull or promotion), else computed by ``digester`` from the bytes just written.
* A block keyed *cold* (``register_key(..., cold=True)``, see `kvstore.policy`) is cached at the least
  recently used end instead, tail first, when ``honour_cold``; a prefix hit (`warm`, which the store's
  `load` calls) makes it ordinary. Other references (a lease, a fork) leave it cold. In-use blocks
  are in no order at all: nothing evicts them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvrelay.kvstore.block_key import BlockKey

EvictHook = Callable[[int, BlockKey], None]
# ``digester(block_ids, keys) -> digests``: the digest of each block's bytes under its key, in one batch.
Digester = Callable[[Sequence[int], Sequence[BlockKey]], list[int]]


class PoolListener(Protocol):
    """Told about keys entering and leaving the pool (KV events); called on the pool owner's thread."""

    def block_stored(self, block_id: int, key: BlockKey, digest: int | None) -> None: ...

    def block_removed(self, block_id: int, key: BlockKey) -> None: ...


class NoFreeBlocksError(RuntimeError):
    """Raised by `BlockPool.allocate` when fewer blocks are free or cached than asked for."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"need {needed} KV blocks but only {available} are free or evictable")
        self.needed = needed
        self.available = available


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    num_free: int
    num_cached: int
    num_in_use: int


class BlockPool:
    """Ref-counted blocks ``0 .. num_blocks-1`` with an LRU prefix cache.

    Args:
        num_blocks: blocks in the pool (> 0).
        on_evict: called as ``on_evict(block_id, key)`` just before a cached block loses its key
            to be reallocated, while its bytes are still intact (the tiered store demotes here).
        honour_cold: cache cold blocks at the least recently used end (tier policy ``cold-tail``);
            when False they are ordered as any other, but still reported cold by `is_cold`.
        digester: computes the digests of blocks keyed without one; None: such blocks carry none
            (``kvstore.integrity: off``, or a pool with no bytes behind it).
    """

    def __init__(self, num_blocks: int, *, on_evict: EvictHook | None = None, honour_cold: bool = False,
                 digester: Digester | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._on_evict = on_evict
        self.honour_cold = honour_cold
        self.digester = digester
        # Owned by BlockPool alone: every field below changes only inside this class.
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self._block_id_to_key: dict[int, BlockKey] = {}
        self._key_to_block_id: dict[BlockKey, int] = {}
        self._cold: set[int] = set()  # keyed blocks registered cold and not hit since
        self._block_id_to_digest: dict[int, int] = {}
        self._listeners: list[PoolListener] = []

    def add_listener(self, listener: PoolListener) -> None:
        """Report every key registered (`register_key`) and dropped (eviction) from now on."""
        self._listeners.append(listener)

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an `allocate` call can have now: free plus cached (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def stats(self) -> PoolStats:
        free, cached = len(self._free), len(self._cached)
        return PoolStats(self.num_blocks, free, cached, self.num_blocks - free - cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._block_id_to_key.get(block_id)

    def block_id_of(self, key: BlockKey) -> int | None:
        return self._key_to_block_id.get(key)

    def digest_of(self, block_id: int) -> int | None:
        """The digest a keyed block carries (None: unkeyed, or keyed with no digester)."""
        return self._block_id_to_digest.get(block_id)

    def is_cold(self, block_id: int) -> bool:
        """Whether the block was keyed cold and not hit since (valid in ``on_evict`` too)."""
        return block_id in self._cold

    def match_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """Block ids of the longest leading run of ``keys`` held by this pool.

        Changes no ref count and no LRU position; call `acquire` on the result to use it.
        """
        block_ids: list[int] = []
        for key in keys:
            block_id = self._key_to_block_id.get(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def coldest_cached(self, limit: int) -> list[int]:
        """Up to ``limit`` cached block ids, least recently used first (the next to be evicted)."""
        out: list[int] = []
        for block_id in self._cached:
            if len(out) == limit:
                break
            out.append(block_id)
        return out

    # --------------------------------------------------------------- mutations
    def try_allocate(self, num: int) -> list[int] | None:
        """``num`` blocks with ref count 1, or None (nothing changed) if too few are available."""
        if num > self.num_free_blocks:
            return None
        out: list[int] = []
        for _ in range(num):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._cached.popitem(last=False)
                self._drop_key(block_id)
            self._ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def allocate(self, num: int) -> list[int]:
        """Like `try_allocate`. Raises NoFreeBlocksError when too few blocks are available."""
        blocks = self.try_allocate(num)
        if blocks is None:
            raise NoFreeBlocksError(num, self.num_free_blocks)
        return blocks

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a prefix hit or a fork). Cached blocks become in use.

        Raises:
            ValueError: a block is free (holds nothing to share).
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._cached:
                    raise ValueError(f"block {block_id} is free; only in-use or cached blocks can be acquired")
                del self._cached[block_id]
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, walking ``block_ids`` back to front.

        A block reaching ref 0 becomes cached (most recently used) if keyed, else free; with
        ``honour_cold``, cold blocks go to the least recently used end instead, the last one first.

        Raises:
            ValueError: a block's ref count is already 0 (double release).
        """
        cold: list[int] = []
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} released more often than acquired")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._block_id_to_key:
                    self._cached[block_id] = None
                    if self.honour_cold and block_id in self._cold:
                        cold.append(block_id)
                else:
                    self._free.append(block_id)
        for block_id in reversed(cold):
            self._cached.move_to_end(block_id, last=False)

    def warm(self, block_ids: Sequence[int]) -> None:
        """These blocks were hit (or are wanted again soon): no longer cold. Unkeyed ids are ignored."""
        self._cold.difference_update(block_ids)

    def register_keys(self, block_ids: Sequence[int], keys: Sequence[BlockKey], cold: Sequence[bool]) -> list[bool]:
        """`register_key` for each block, with the digests of those that get their key computed in one
        ``digester`` call. Returns what each `register_key` returned."""
        todo = [i for i, (b, k) in enumerate(zip(block_ids, keys, strict=True))
                if k not in self._key_to_block_id and b not in self._block_id_to_key]
        digests: list[int | None] = [None] * len(block_ids)
        if self.digester is not None and todo:
            for i, d in zip(todo, self.digester([block_ids[i] for i in todo], [keys[i] for i in todo]), strict=True):
                digests[i] = d
        return [self.register_key(b, k, cold=c, digest=d)
                for b, k, c, d in zip(block_ids, keys, cold, digests, strict=True)]

    def register_key(self, block_id: int, key: BlockKey, *, cold: bool = False, digest: int | None = None) -> bool:
        """Make an in-use, full block shareable under ``key``; ``cold``: predicted not to be reused
        (`kvstore.policy`), cached at the least recently used end when released. ``digest``: the digest
        the bytes arrived with (already checked); None computes it with ``digester``, if there is one.

        Returns False (and changes nothing) if another block already holds ``key`` — the caller's
        block stays private — or if this block already has a key.

        Raises:
            ValueError: the block is not in use.
        """
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not in use; only in-use blocks can be keyed")
        if key in self._key_to_block_id or block_id in self._block_id_to_key:
            return False
        if digest is None and self.digester is not None:
            digest = self.digester([block_id], [key])[0]
        self._key_to_block_id[key] = block_id
        self._block_id_to_key[block_id] = key
        if digest is not None:
            self._block_id_to_digest[block_id] = digest
        if cold:
            self._cold.add(block_id)
        for listener in self._listeners:
            listener.block_stored(block_id, key, digest)
        return True

    def evict_cached(self, block_ids: Sequence[int]) -> None:
        """Drop the keys of these cached blocks and free them (``on_evict`` runs for each).

        Raises:
            ValueError: a block is not cached.
        """
        for block_id in block_ids:
            if block_id not in self._cached:
                raise ValueError(f"block {block_id} is not cached")
            del self._cached[block_id]
            self._drop_key(block_id)
            self._free.append(block_id)

    def _drop_key(self, block_id: int) -> None:
        key = self._block_id_to_key.pop(block_id)
        del self._key_to_block_id[key]
        if self._on_evict is not None:
            self._on_evict(block_id, key)
        self._cold.discard(block_id)
        self._block_id_to_digest.pop(block_id, None)
        for listener in self._listeners:
            listener.block_removed(block_id, key)

    # --------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert free + cached + in use == total and that ref counts, keys and lists agree.

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is listed twice in the free list"
        assert not free & cached, f"blocks both free and cached: {sorted(free & cached)}"
        in_use = {b for b in range(self.num_blocks) if self._ref_counts[b] > 0}
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != total {self.num_blocks}"
        )
        for b in free:
            assert self._ref_counts[b] == 0, f"free block {b} has ref count {self._ref_counts[b]}"
            assert b not in self._block_id_to_key, f"free block {b} still has a key"
        for b in cached:
            assert self._ref_counts[b] == 0, f"cached block {b} has ref count {self._ref_counts[b]}"
            assert b in self._block_id_to_key, f"cached block {b} has no key"
        assert all(c >= 0 for c in self._ref_counts), "negative ref count"
        assert len(self._key_to_block_id) == len(self._block_id_to_key), "key maps differ in size"
        stray = self._cold - self._block_id_to_key.keys()
        assert not stray, f"cold blocks without a key: {sorted(stray)}"
        stray = self._block_id_to_digest.keys() - self._block_id_to_key.keys()
        assert not stray, f"digests of blocks without a key: {sorted(stray)}"
        for key, b in self._key_to_block_id.items():
            assert self._block_id_to_key.get(b) == key, f"key map and block map disagree on block {b}"
