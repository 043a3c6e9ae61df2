"""Block digests on the device: XXH3-64 (xxHash v0.8, seeded) of many KV blocks in one launch.

For each listed block ``i``::

    out[i] = xxhash.xxh3_64_intdigest(bytes of pool[block_ids[i]], seed=seeds[i])   as an int64 bit pattern

The bytes of a block are ``pool[b]`` in C order, ``block_bytes = pool[0].numel() * pool.element_size()``;
any dtype. Seeds and digests are u64 values carried in int64 tensors (two's complement bit patterns: a seed
``s >= 2**63`` is stored as ``s - 2**64``; ``int(out[i]) & (2**64 - 1)`` is the digest).

`digest_blocks` (Triton) computes only XXH3's long-input path, so it needs ``block_bytes > 240`` and
``block_bytes % 8 == 0``; it raises ValueError otherwise, and callers use `digest_blocks_reference`, the
xxhash-library oracle, which takes any pool. Works on CUDA tensors, or on CPU tensors when Triton runs with
``TRITON_INTERPRET=1`` (tests).

Long path, per block (one program each; a chunk is 16 stripes of 64 bytes, read as ``[16, 8]`` u64 words)::

    bytes:  [ chunk 0 | chunk 1 | ... | chunk C-1 | tail stripes (0..15) ...... ]   C = (block_bytes - 1) // 1024
                                                               [ last stripe ]   (the final 64 bytes, again)
    acc (8 u64 lanes) += each stripe, scrambled after every full chunk; then merged and avalanched
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import xxhash
from kvrelay.kernels.triton_attention import _check_same_device, _require

U64_MASK = (1 << 64) - 1
STRIPE_BYTES = 64
STRIPE_WORDS = 8
STRIPES_PER_CHUNK = 16  # (secret bytes - stripe bytes) / 8 bytes of secret consumed per stripe
CHUNK_BYTES = STRIPE_BYTES * STRIPES_PER_CHUNK
# Shorter inputs take XXH3's other paths (0-16, 17-128, 129-240 bytes), which the kernel does not implement.
MIN_KERNEL_BYTES = 241
# A chunk is 128 words; with one warp per program the per-chunk sum over stripes stays within the warp.
NUM_WARPS = 1

# XXH3_kSecret from xxhash.h (192 bytes); with a seed, 8-byte word w becomes word + seed (w even) or
# word - seed (w odd), mod 2**64.
K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
SECRET_WORDS = len(K_SECRET) // 8
# XXH3_INIT_ACC: PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1.
INIT_ACC = (0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
            0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1)
# Byte offsets into the (seeded) secret: the scramble key, the last stripe's key and the merge key.
SCRAMBLE_SECRET_BYTE = len(K_SECRET) - STRIPE_BYTES
LAST_STRIPE_SECRET_BYTE = len(K_SECRET) - STRIPE_BYTES - 7
MERGE_SECRET_BYTE = 11


def _to_int64(u64: int) -> int:
    return u64 - (1 << 64) if u64 >= 1 << 63 else u64


def _constant_words() -> tuple[int, ...]:
    """The kernel's constants as int64 bit patterns: the 24 secret words, then the 8 initial lanes."""
    secret = (int.from_bytes(K_SECRET[8 * w : 8 * w + 8], "little") for w in range(SECRET_WORDS))
    return tuple(_to_int64(v) for v in (*secret, *INIT_ACC))


def _check_ids(block_ids: torch.Tensor, seeds: torch.Tensor) -> None:
    _require(block_ids.dim() == 1 and block_ids.dtype == torch.int64,
             f"block_ids must be 1-D int64, got shape {tuple(block_ids.shape)} {block_ids.dtype}")
    _require(seeds.dim() == 1 and seeds.dtype == torch.int64,
             f"seeds must be 1-D int64 (u64 bit patterns), got shape {tuple(seeds.shape)} {seeds.dtype}")
    _require(seeds.shape == block_ids.shape,
             f"seeds has {seeds.shape[0]} entries for {block_ids.shape[0]} block_ids")


def _check_pool(pool: torch.Tensor) -> int:
    """``pool`` fits the kernel; returns ``block_bytes``."""
    _require(pool.dim() >= 2, f"pool must be [num_blocks, ...] with >= 2 dims, got shape {tuple(pool.shape)}")
    _require(pool.is_contiguous(), f"pool must be contiguous, got strides {pool.stride()} for {tuple(pool.shape)}")
    block_bytes = pool[0].numel() * pool.element_size()
    _require(block_bytes >= MIN_KERNEL_BYTES and block_bytes % 8 == 0,
             f"block_bytes {block_bytes} must be a multiple of 8 and >= {MIN_KERNEL_BYTES} for the kernel; "
             "use digest_blocks_reference")
    _require(pool.data_ptr() % 8 == 0, f"pool data must be 8-byte aligned, got address {pool.data_ptr():#x}")
    return block_bytes


def digest_blocks(pool: torch.Tensor, block_ids: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """XXH3-64 of each listed block's bytes with its own seed, one program per listed block.

    Args:
        pool: ``[num_blocks, ...]`` of any dtype, contiguous, 8-byte aligned; ``block_bytes`` (bytes of
            ``pool[0]``) a multiple of 8 and > 240.
        block_ids: ``[n]`` int64, in any order, repeats allowed; each in ``[0, num_blocks)`` (not checked:
            it would need a device sync).
        seeds: ``[n]`` int64, each a u64 seed as its bit pattern.

    Returns:
        int64 ``[n]`` on ``pool``'s device, newly allocated: ``out[i]`` is the bit pattern of
        ``xxhash.xxh3_64_intdigest(bytes of pool[block_ids[i]], seed=seeds[i] mod 2**64)``, equal to
        `digest_blocks_reference`. Nothing is mutated.

    Raises:
        ValueError: a shape, dtype, contiguity, alignment, block size or device does not fit, naming which.
    """
    _check_ids(block_ids, seeds)
    block_bytes = _check_pool(pool)
    device = _check_same_device(pool=pool, block_ids=block_ids, seeds=seeds)
    num_listed = block_ids.shape[0]
    out = torch.empty(num_listed, dtype=torch.int64, device=device)
    if num_listed == 0:
        return out
    words = pool.reshape(pool.shape[0], -1).view(torch.uint8).view(torch.int64)  # [num_blocks, block_bytes / 8]
    constants = torch.tensor(_constant_words(), dtype=torch.int64, device=device)
    num_chunks = (block_bytes - 1) // CHUNK_BYTES
    tail_stripes = (block_bytes - 1 - num_chunks * CHUNK_BYTES) // STRIPE_BYTES
    _digest_kernel[(num_listed,)](
        words, block_ids, seeds, constants, out, block_bytes // 8, num_chunks, tail_stripes,
        STRIPES=STRIPES_PER_CHUNK, LANES=STRIPE_WORDS, SECRET_WORDS=SECRET_WORDS,
        SCRAMBLE_BYTE=SCRAMBLE_SECRET_BYTE, LAST_STRIPE_BYTE=LAST_STRIPE_SECRET_BYTE, MERGE_BYTE=MERGE_SECRET_BYTE,
        num_warps=NUM_WARPS,
    )
    return out


def digest_blocks_reference(pool: torch.Tensor, block_ids: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """`digest_blocks` by the xxhash library on the CPU: the oracle in tests and the path for any pool.

    Takes any pool (any strides, block size and device: listed blocks are copied to the CPU) and the same
    ``block_ids`` and ``seeds``; ids out of range raise IndexError. Returns int64 ``[n]`` on ``pool``'s device.

    Raises:
        ValueError: ``block_ids`` or ``seeds`` is not 1-D int64 of one length.
    """
    _check_ids(block_ids, seeds)
    blocks = pool[block_ids.to(pool.device)].cpu().contiguous()
    listed_seeds = seeds.cpu().tolist()
    digests = [
        xxhash.xxh3_64_intdigest(blocks[i].reshape(-1).view(torch.uint8).numpy(), seed=seed & U64_MASK)
        for i, seed in enumerate(listed_seeds)
    ]
    return torch.tensor([_to_int64(d) for d in digests], dtype=torch.int64).to(pool.device)


@triton.jit
def _digest_kernel(
    words_ptr: tl.tensor, block_ids_ptr: tl.tensor, seeds_ptr: tl.tensor, constants_ptr: tl.tensor,
    out_ptr: tl.tensor, block_words: tl.tensor, num_chunks: tl.tensor, tail_stripes: tl.tensor,
    STRIPES: tl.constexpr, LANES: tl.constexpr, SECRET_WORDS: tl.constexpr,
    SCRAMBLE_BYTE: tl.constexpr, LAST_STRIPE_BYTE: tl.constexpr, MERGE_BYTE: tl.constexpr,
):
    """One program per listed block: XXH3_hashLong_64b_withSeed over its ``block_words`` u64 words.

    ``constants`` holds the unseeded secret words, then the 8 initial accumulator lanes.
    """
    i = tl.program_id(0)
    block = tl.load(block_ids_ptr + i)
    seed = tl.load(seeds_ptr + i).to(tl.uint64, bitcast=True)
    block_ptr = words_ptr + block * block_words

    stripes = tl.arange(0, STRIPES)[:, None]
    lanes = tl.arange(0, LANES)
    chunk_tile = stripes * LANES + lanes[None, :]  # [STRIPES, LANES] word offsets of a chunk
    # Stripe s of a chunk uses the secret from byte 8 * s (word s): word s + lane.
    stripe_secret = _secret_words(constants_ptr, stripes + lanes[None, :], seed)
    scramble_secret = _secret_at(constants_ptr, SCRAMBLE_BYTE, lanes, seed)
    acc = tl.load(constants_ptr + SECRET_WORDS + lanes).to(tl.uint64, bitcast=True)

    all_stripes = stripes < STRIPES
    for chunk in range(num_chunks):
        data = tl.load(block_ptr + chunk * (STRIPES * LANES) + chunk_tile).to(tl.uint64, bitcast=True)
        acc = _accumulate(acc, data, stripe_secret, all_stripes, lanes)
        acc = _scramble(acc, scramble_secret)

    tail = stripes < tail_stripes
    data = tl.load(block_ptr + num_chunks * (STRIPES * LANES) + chunk_tile, mask=tail, other=0)
    acc = _accumulate(acc, data.to(tl.uint64, bitcast=True), stripe_secret, tail, lanes)

    last = tl.load(block_ptr + block_words - LANES + lanes).to(tl.uint64, bitcast=True)
    last_secret = _secret_at(constants_ptr, LAST_STRIPE_BYTE, lanes, seed)
    acc = _accumulate(acc, last[None, :], last_secret[None, :], lanes[None, :] >= 0, lanes)

    merged = acc ^ _secret_at(constants_ptr, MERGE_BYTE, lanes, seed)
    pairs = tl.arange(0, LANES // 2)
    folded = _mul128_fold64(_pick(merged, 2 * pairs, lanes), _pick(merged, 2 * pairs + 1, lanes))
    start = (block_words * 8).to(tl.uint64) * 0x9E3779B185EBCA87  # block_bytes * PRIME64_1
    digest = _avalanche(start + tl.sum(folded, axis=0))
    tl.store(out_ptr + i, digest.to(tl.int64, bitcast=True))


@triton.jit
def _secret_words(constants_ptr: tl.tensor, word: tl.tensor, seed: tl.tensor) -> tl.tensor:
    """Seeded secret words at indices ``word`` (any shape): ``+ seed`` on even words, ``- seed`` on odd."""
    k = tl.load(constants_ptr + word).to(tl.uint64, bitcast=True)
    return tl.where(word % 2 == 0, k + seed, k - seed)


@triton.jit
def _secret_at(constants_ptr: tl.tensor, BYTE: tl.constexpr, lanes: tl.tensor, seed: tl.tensor) -> tl.tensor:
    """The ``[LANES]`` little-endian u64 secret words starting at byte ``BYTE`` (aligned or not)."""
    low = _secret_words(constants_ptr, BYTE // 8 + lanes, seed)
    if BYTE % 8 == 0:
        return low
    else:
        high = _secret_words(constants_ptr, BYTE // 8 + 1 + lanes, seed)
        return (low >> (8 * (BYTE % 8))) | (high << (64 - 8 * (BYTE % 8)))


@triton.jit
def _accumulate(acc: tl.tensor, data: tl.tensor, secret: tl.tensor, valid: tl.tensor, lanes: tl.tensor) -> tl.tensor:
    """XXH3_accumulate_512 over every valid row (stripe) of ``data`` ``[S, LANES]``; rows only add up.

    Per stripe: ``acc[j] += lo32(k) * hi32(k)`` with ``k = data[j] ^ secret[j]``, and ``acc[j ^ 1] += data[j]``.
    Invalid rows must hold 0 in ``data``.
    """
    key = data ^ secret
    product = tl.where(valid, (key & 0xFFFFFFFF) * (key >> 32), 0)
    return acc + tl.sum(product, axis=0) + _pick(tl.sum(data, axis=0), lanes ^ 1, lanes)


@triton.jit
def _scramble(acc: tl.tensor, secret: tl.tensor) -> tl.tensor:
    acc = acc ^ (acc >> 47)
    return (acc ^ secret) * 0x9E3779B1  # PRIME32_1


@triton.jit
def _pick(x: tl.tensor, index: tl.tensor, lanes: tl.tensor) -> tl.tensor:
    """``x[index]`` for a ``[LANES]`` vector ``x`` and a 1-D ``index`` (a select-and-sum: no gather needed)."""
    return tl.sum(tl.where(index[:, None] == lanes[None, :], x[None, :], 0), axis=1)


@triton.jit
def _mul128_fold64(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    """Low 64 bits xor high 64 bits of the 128-bit product ``a * b`` (xxhash's portable XXH_mult64to128)."""
    lo_lo = (a & 0xFFFFFFFF) * (b & 0xFFFFFFFF)
    hi_lo = (a >> 32) * (b & 0xFFFFFFFF)
    lo_hi = (a & 0xFFFFFFFF) * (b >> 32)
    hi_hi = (a >> 32) * (b >> 32)
    cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFF) + lo_hi
    high = (hi_lo >> 32) + (cross >> 32) + hi_hi
    low = (cross << 32) | (lo_lo & 0xFFFFFFFF)
    return low ^ high


@triton.jit
def _avalanche(h: tl.tensor) -> tl.tensor:
    h = h ^ (h >> 37)
    h = h * 0x165667919E3779F9
    return h ^ (h >> 32)
