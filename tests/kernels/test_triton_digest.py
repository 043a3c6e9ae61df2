"""`kernels.triton_digest` against the xxhash library, bit for bit.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by this folder's conftest); with CUDA it runs
compiled. Pools hold random bytes (float pools include NaN and inf bit patterns: only bytes matter), block
ids come shuffled and repeated, and seeds cover 0, 1, one past 2**63 and random u64 values.
"""

from __future__ import annotations

import random

import pytest
import torch
import xxhash
from kvrelay.kernels import triton_digest as td
from kvrelay.kvstore.block_spec import BlockSpec

U64_MASK = (1 << 64) - 1
SEEDS_U64 = (0, 1, 2**63 + 5, 0xFFFFFFFFFFFFFFFF)
IDS = (3, 0, 3, 4, 1, 4, 2, 0)  # shuffled, with repeats


def random_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, seed: int) -> torch.Tensor:
    """A contiguous pool of ``shape`` whose bytes are uniformly random."""
    gen = torch.Generator().manual_seed(seed)
    num_bytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape).to(device)


def seeds_tensor(seeds_u64: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds_u64], dtype=torch.int64, device=device)


def library_digests(pool: torch.Tensor, ids: list[int], seeds_u64: list[int]) -> list[int]:
    """What the xxhash library gives for each listed block's bytes (u64)."""
    host = pool.cpu()
    return [xxhash.xxh3_64_intdigest(bytes(host[b].reshape(-1).view(torch.uint8).numpy()), seed=s)
            for b, s in zip(ids, seeds_u64, strict=True)]


def as_u64(digests: torch.Tensor) -> list[int]:
    assert digests.dtype == torch.int64 and digests.dim() == 1
    return [d & U64_MASK for d in digests.tolist()]


def check_against_library(pool: torch.Tensor, ids: list[int], seeds_u64: list[int]) -> list[int]:
    """Kernel and reference both equal the library; returns the digests."""
    device = pool.device
    block_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    seeds = seeds_tensor(seeds_u64, device)
    got = td.digest_blocks(pool, block_ids, seeds)
    want = library_digests(pool, ids, seeds_u64)
    assert got.device == device
    assert as_u64(got) == want
    assert as_u64(td.digest_blocks_reference(pool, block_ids, seeds)) == want
    return want


def mixed_seeds(count: int, *, seed: int) -> list[int]:
    rng = random.Random(seed)
    fixed = list(SEEDS_U64)
    return [fixed[i] if i < len(fixed) else rng.getrandbits(64) for i in range(count)]


# block_bytes around the chunk (1024) and stripe (64) edges: 248 and 1024 are tail stripes only, 1032 one
# chunk and no tail stripe, 1088 one chunk and one tail stripe, 2048 one chunk and 15 tail stripes.
@pytest.mark.parametrize(
    ("block_shape", "dtype"),
    [
        ((62,), torch.float32),            # 248 B
        ((128,), torch.float16),           # 256 B
        ((2, 8, 16), torch.float32),       # 1024 B
        ((1032,), torch.uint8),            # 1032 B
        ((2, 17, 16), torch.bfloat16),     # 1088 B
        ((2048,), torch.uint8),            # 2048 B
        ((4, 4, 64), torch.float32),       # 4096 B
        ((2, 2, 16, 72), torch.float16),   # 9216 B
    ],
    ids=lambda v: str(v).replace("torch.", "").replace(" ", ""),
)
def test_digest_matches_xxhash(block_shape, dtype, kernel_device):
    pool = random_pool((5, *block_shape), dtype, kernel_device, seed=len(block_shape) * 1000 + block_shape[-1])
    check_against_library(pool, list(IDS), mixed_seeds(len(IDS), seed=block_shape[-1]))


def test_digest_real_layout(kernel_device):
    spec = BlockSpec(num_layers=5, num_kv_heads=2, head_dim=64, block_size_tokens=16, dtype="bfloat16")
    assert spec.block_bytes == 40960
    pool = random_pool(spec.pool_shape(3), spec.torch_dtype, kernel_device, seed=7)
    check_against_library(pool, [2, 0, 2], mixed_seeds(3, seed=7))


def test_digest_single_block(kernel_device):
    pool = random_pool((1, 300), torch.float32, kernel_device, seed=11)
    check_against_library(pool, [0], [2**63 + 5])


def test_digest_repeated_block_same_seed_is_equal(kernel_device):
    pool = random_pool((2, 1096), torch.uint8, kernel_device, seed=12)
    first, second, other = check_against_library(pool, [1, 1, 1], [9, 9, 10])
    assert first == second != other


@pytest.mark.parametrize("position", [0, 700, 1500, 2047, 2055, 2111])
def test_one_byte_changes_the_digest(position, kernel_device):
    """A flipped byte in a full chunk, in the tail stripes, in the last stripe, and the very last byte."""
    pool = random_pool((2, 2112), torch.uint8, kernel_device, seed=13)
    before = check_against_library(pool, [1, 0], [5, 5])
    pool[1, position] ^= 0x01
    after = check_against_library(pool, [1, 0], [5, 5])
    assert after[0] != before[0] and after[1] == before[1]


def test_no_blocks_listed(kernel_device):
    pool = random_pool((2, 256), torch.uint8, kernel_device, seed=14)
    empty = torch.zeros(0, dtype=torch.int64, device=kernel_device)
    out = td.digest_blocks(pool, empty, empty)
    assert out.shape == (0,) and out.dtype == torch.int64


def test_reference_takes_any_pool():
    """The CPU path for what the kernel refuses: short or odd-sized blocks and non-contiguous pools."""
    pool = random_pool((3, 20, 5), torch.float16, torch.device("cpu"), seed=15)  # 200 B blocks
    strided = random_pool((3, 300, 2), torch.uint8, torch.device("cpu"), seed=16)[:, :, 0]
    for p in (pool, strided):
        ids, seeds_u64 = [2, 0], [0, 2**63 + 5]
        got = td.digest_blocks_reference(p, torch.tensor(ids), seeds_tensor(seeds_u64, p.device))
        assert as_u64(got) == library_digests(p, ids, seeds_u64)


def _digest_args(device: torch.device) -> dict:
    return dict(pool=torch.zeros(4, 64, dtype=torch.float32, device=device),
                block_ids=torch.tensor([0, 1], device=device), seeds=torch.tensor([0, 1], device=device))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(pool=a["pool"][:, :60]), r"pool must be contiguous"),
        (lambda a: a.update(pool=a["pool"][:, :60].contiguous()), r"block_bytes 240 must be .* >= 241"),
        (lambda a: a.update(pool=torch.zeros(4, 250, dtype=torch.uint8)), r"block_bytes 250 must be a multiple of 8"),
        (lambda a: a.update(pool=a["pool"].reshape(-1)), r"pool must be \[num_blocks, \.\.\.\] with >= 2 dims"),
        (lambda a: a.update(pool=torch.zeros(4 * 256 + 1, dtype=torch.uint8)[1:].view(4, 256)),
         r"pool data must be 8-byte aligned"),
        (lambda a: a.update(block_ids=a["block_ids"].int()), r"block_ids must be 1-D int64"),
        (lambda a: a.update(seeds=a["seeds"].double()), r"seeds must be 1-D int64"),
        (lambda a: a.update(seeds=a["seeds"][:1]), r"seeds has 1 entries for 2 block_ids"),
        (lambda a: a.update(seeds=torch.zeros(2, dtype=torch.int64, device="meta")),
         r"tensors are on different devices"),
    ],
)
def test_digest_launcher_rejects(change, message, kernel_device):
    args = _digest_args(kernel_device)
    change(args)
    with pytest.raises(ValueError, match=message):
        td.digest_blocks(**args)


# --- compiled on CUDA -------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "spec",
    [
        BlockSpec(num_layers=24, num_kv_heads=8, head_dim=128, block_size_tokens=16, dtype="bfloat16"),  # 1.5 MiB
        BlockSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size_tokens=16, dtype="bfloat16"),   # 360 KiB
        BlockSpec(num_layers=3, num_kv_heads=2, head_dim=80, block_size_tokens=16, dtype="float32"),     # 60 KiB
    ],
    ids=lambda s: f"{s.block_bytes}B",
)
def test_gpu_digest_matches_reference(spec):
    device = torch.device("cuda")
    num_blocks = 40
    pool = random_pool(spec.pool_shape(num_blocks), spec.torch_dtype, device, seed=spec.block_bytes)
    gen = torch.Generator().manual_seed(17)
    ids = torch.cat([torch.randperm(num_blocks, generator=gen), torch.tensor([5, 5, 0])]).to(device)
    seeds = seeds_tensor(mixed_seeds(ids.shape[0], seed=17), device)
    got = td.digest_blocks(pool, ids, seeds)
    assert torch.equal(got, td.digest_blocks_reference(pool, ids, seeds))
