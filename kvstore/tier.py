"""`Tier`: the contract of a tier below ``device`` (``host``, ``disk``).

The device tier is the `BlockPool` plus the pool tensor the model computes on; the tiers below it
are key → block stores with their own capacity and LRU, composed by `TieredStore`::

    device (BlockPool) ──evict──▶ host (HostTier) ──evict──▶ disk (LmdbTier) ──evict──▶ gone
          ▲                          │                          │
          └──────── load (promote) ──┴──────────────────────────┘
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_mover import Block


@dataclass(frozen=True, slots=True)
class TierStats:
    """Occupancy of one tier. ``num_blocks`` held now, ``capacity_blocks`` at most."""

    tier: str
    num_blocks: int
    capacity_blocks: int
    block_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


class Tier(Protocol):
    """A key → block store below device.

    Blocks are tensors of ``BlockSpec.block_shape`` and the spec's dtype, or a CPU block's bytes as a
    uint8 numpy row (`block_mover.Block`); the bytes stored under a key never change (a key names them).

    * ``put(key, src, digest=None)`` stores a copy of ``src`` (any device) under ``key``, with the
      block's digest (`kvstore.digest`) when known, or refreshes its LRU position if the key is already
      held (copying nothing). It may evict least-recently-used keys to make room. Returns whether the
      key is held (or queued to be) afterwards.
    * ``get_into(key, dst)`` copies the block into ``dst`` and refreshes its LRU position. False is a
      miss and says nothing about ``dst``. The host tier copies what its memory holds (the store checks
      it); the disk tier checks its record checksum (the digest, with integrity on) — a record still
      queued for writing against the digest it was put with — and returns True only when it holds.
    * ``digest_of(key)``: the block's digest, None when not known (the caller checks `get_into`'s bytes).
    * ``contains``, ``match_prefix`` (length of the leading run of ``keys`` held) change nothing.
    * ``touch(key)`` refreshes the LRU position; False if the key is not held.
    * ``discard(key)`` forgets the key; False if it was not held.
    * ``check_integrity()`` raises AssertionError naming the first inconsistency.
    """

    name: str

    def put(self, key: BlockKey, src: Block, *, digest: int | None = None) -> bool: ...

    def get_into(self, key: BlockKey, dst: Block) -> bool: ...

    def digest_of(self, key: BlockKey) -> int | None: ...

    def contains(self, key: BlockKey) -> bool: ...

    def match_prefix(self, keys: Sequence[BlockKey]) -> int: ...

    def touch(self, key: BlockKey) -> bool: ...

    def discard(self, key: BlockKey) -> bool: ...

    def check_integrity(self) -> None: ...

    def stats(self) -> TierStats: ...
