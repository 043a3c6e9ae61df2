"""Block digests: a 64-bit fingerprint of a keyed block's bytes, checked wherever the block lands.

::

    digest(key, block) = xxh3_64(block bytes, seed = u64-LE of key[0:8])

* The seed binds the digest to the block key, and through the key's SHA-256 chain (`kvstore.block_key`)
  to the whole token prefix, the cache salt and the `BlockSpec` fingerprint (model weights and layout):
  the same bytes under another key, model or tenant give another digest.
* Computed once, when a block becomes keyed (`BlockPool.register_key`, from the bytes the model just
  wrote), then carried with the block: in the host tier's index, in the disk record's header (the record
  checksum is this digest), in the `KvHandle` and the KV events. It is computed again from landed bytes
  only for a block that arrives without one (from a node with integrity off, or an older record whose
  own checksum held).
* Checked (`IntegrityPolicy`) after every NIXL READ, on every promotion to device, after every InfiniGen
  recall (per layer slice: `digest_slices`), and by ``kvrelay store verify``. A mismatch is a miss.
  Disk records are checked whole on every read in every mode (their checksum is the digest).
* xxh3 comes from the ``xxhash`` package (≈ 25 GB/s from memory, ≈ 60 GB/s from cache on one core of
  the 2-core build machine). On CUDA, `kernels.triton_digest` computes the same function for many
  blocks in one launch.

xxh3 detects accidental corruption (flipped, zeroed, stale or swapped bytes) — not an adversary who can
write KV memory, which no check in the same address space could stop.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:  # deploy.config reads the modes below in the router, which does not load torch
    import numpy as np
    import torch
    from kvrelay.kvstore.block_key import BlockKey

INTEGRITY_MODES = ("off", "sampled", "all")
# `kvrelay bench transfer` measured the digest of every block a READ landed at 0.35-0.47 of the READ's own
# time on the 2-core build machine (xxh3 ≈ 11-15 GB/s reading what UCX wrote at ≈ 5-6 GB/s), far from the
# 0.05 goal; checking a tenth of the blocks cost up to 0.057 (0.04 on average). So nodes default to
# ``sampled`` at 0.05 (≈ 0.02 of a READ): a damaged run of n blocks is caught with 1 - 0.95^n.
DEFAULT_INTEGRITY = "sampled"
DEFAULT_SAMPLE_RATE = 0.05
INTEGRITY_WHERE = ("nixl_read", "host", "disk", "recall", "verify")  # label values of the failure counter
DIGEST_MASK = (1 << 64) - 1


def seed_of(key: bytes) -> int:
    """The xxh3 seed of a block key: its first 8 bytes as a little-endian u64."""
    return int.from_bytes(key[:8], "little")


def _bytes_of(block: torch.Tensor | np.ndarray) -> np.ndarray:
    import torch

    if not isinstance(block, torch.Tensor):
        return block
    if block.device.type != "cpu":
        raise ValueError(f"block_digest hashes CPU bytes; got a {block.device} tensor (use digest_blocks)")
    return block.contiguous().view(-1).view(torch.uint8).numpy()


def block_digest(key: bytes, block: torch.Tensor | np.ndarray | bytes | memoryview) -> int:
    """The digest (u64) of one block's bytes under ``key``. ``block``: a CPU tensor (any shape and dtype,
    hashed in C order), a numpy array or a bytes-like object.

    Raises:
        ValueError: ``block`` is a tensor on another device.
    """
    data = block if isinstance(block, bytes | memoryview) else _bytes_of(block)
    return xxhash.xxh3_64_intdigest(data, seed=seed_of(key))


def slice_seed(layer: int) -> int:
    """The seed of one layer's slice of a private (unkeyed) block, e.g. an InfiniGen offload: slices of
    different layers get different digests. Hash the slices with `digest_slices`."""
    return 0x6B76_7265_6C61_7900 ^ layer


def digest_blocks(pool: torch.Tensor, block_ids: Sequence[int], seeds: Sequence[int]) -> list[int]:
    """``xxh3_64(pool[block_ids[i]], seeds[i])`` for each i, as u64 ints. On CUDA one Triton launch
    (`kernels.triton_digest`); on CPU one `xxhash` call per block on the row's bytes.

    ``pool``: ``[num_blocks, ...]`` contiguous, block ``b`` = ``pool[b]``'s bytes. ``seeds``: u64 ints.
    """
    if not block_ids:
        return []
    import torch

    if pool.device.type == "cuda":
        if _triton_agrees(pool, block_ids[0], seeds[0]):
            from kvrelay.kernels.triton_digest import digest_blocks as triton_digest_blocks

            out = triton_digest_blocks(pool, _ids(block_ids, pool.device), _signed(seeds, pool.device))
            return [int(d) & DIGEST_MASK for d in out.tolist()]
        pool = pool[list(block_ids)].cpu()  # the kernel cannot take these blocks, or disagreed once
        block_ids = range(len(block_ids))
    rows = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()
    return [xxhash.xxh3_64_intdigest(rows[b], seed=s) for b, s in zip(block_ids, seeds, strict=True)]


_TRITON_OK: bool | None = None  # whether the compiled kernel gave xxhash's digest (checked on first use)


def _ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(list(block_ids), dtype=torch.int64, device=device)


def _signed(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds], dtype=torch.int64, device=device)


def _triton_agrees(pool: torch.Tensor, block_id: int, seed: int) -> bool:
    """Whether the Triton kernel serves this pool: blocks of more than 240 bytes, a multiple of 8, and a
    kernel that gave `xxhash`'s digest for one block on first use (else every check would fail: CPU then)."""
    global _TRITON_OK
    block_bytes = pool[0].numel() * pool.element_size()
    if block_bytes <= 240 or block_bytes % 8:
        return False
    if _TRITON_OK is None:
        import logging

        from kvrelay.kernels.triton_digest import digest_blocks as triton_digest_blocks

        got = int(triton_digest_blocks(pool, _ids([block_id], pool.device), _signed([seed], pool.device))[0])
        _TRITON_OK = got & DIGEST_MASK == digest_blocks(pool[[block_id]].cpu(), [0], [seed])[0]
        if not _TRITON_OK:
            logging.getLogger(__name__).error("the Triton digest kernel disagrees with xxhash on this GPU; "
                                              "hashing KV blocks on the CPU instead")
    return _TRITON_OK


def digest_slices(pool: torch.Tensor, block_ids: Sequence[int], layers: Sequence[int]) -> list[int]:
    """Digest of layer ``layers[i]``'s slice ``pool[block_ids[i], layers[i]]`` (``[P, H, B, D]``, contiguous)
    of each block, seeded by `slice_seed`. ``pool``: ``[num_blocks, L, P, H, B, D]`` contiguous."""
    num_layers = pool.shape[1]
    rows = pool.view(pool.shape[0] * num_layers, -1)  # slice (b, l) is row b·L + l
    return digest_blocks(rows, [b * num_layers + lay for b, lay in zip(block_ids, layers, strict=True)],
                         [slice_seed(lay) for lay in layers])


def digest_keyed(pool: torch.Tensor, block_ids: Sequence[int], keys: Sequence[BlockKey]) -> list[int]:
    """`block_digest` of each ``pool[block_ids[i]]`` under ``keys[i]``, in one batch."""
    return digest_blocks(pool, block_ids, [seed_of(k) for k in keys])


@dataclass(frozen=True, slots=True)
class IntegrityPolicy:
    """``kvstore.integrity``: which blocks are checked where they land.

    * ``off``: no digest is computed, carried or checked (the disk tier keeps its own record checksum).
    * ``all``: every block is checked at every landing.
    * ``sampled``: digests are computed and carried for every block, and each landing checks a block with
      probability ``sample_rate`` (a corrupt run of ``n`` blocks goes unseen with ``(1 - rate)^n``).

    Raises:
        ValueError: an unknown mode or a rate outside (0, 1].
    """

    mode: str = DEFAULT_INTEGRITY
    sample_rate: float = DEFAULT_SAMPLE_RATE

    def __post_init__(self) -> None:
        if self.mode not in INTEGRITY_MODES:
            raise ValueError(f"integrity {self.mode!r} is not one of {', '.join(INTEGRITY_MODES)}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"integrity sample_rate must be in (0, 1], got {self.sample_rate}")

    @property
    def enabled(self) -> bool:
        """Whether digests are computed and carried."""
        return self.mode != "off"

    def pick(self, n: int, rng: random.Random | None = None) -> list[int]:
        """Indices (ascending) of the ``n`` landed blocks to check."""
        if self.mode == "all":
            return list(range(n))
        if self.mode == "off":
            return []
        r = rng or random
        return [i for i in range(n) if r.random() < self.sample_rate]
