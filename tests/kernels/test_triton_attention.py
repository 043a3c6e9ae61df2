"""Triton decode kernels against `kernels.reference`.

On CPU these run under ``TRITON_INTERPRET=1`` (set by this folder's conftest); with CUDA they run
compiled. KV lives in non-contiguous layer views of a real pool, and block tables hold shuffled,
non-consecutive block ids padded with out-of-range ids that must never be read.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kvrelay.kernels import reference
from kvrelay.kernels import triton_attention as ta
from kvrelay.kvstore.block_spec import BlockSpec

NUM_LAYERS = 3
LAYER = 1
PAD_BLOCK_ID = 1 << 20  # far past the pool: reading it would fault or give garbage


@dataclass(frozen=True)
class Case:
    """One decode comparison; ``lens`` are given exactly, ``table_blocks`` is the block-table width."""

    lens: tuple[int, ...]
    group: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    table_blocks: int

    def __str__(self) -> str:
        return (f"n{len(self.lens)}-g{self.group}-kv{self.num_kv_heads}-d{self.head_dim}"
                f"-b{self.block_size}-w{self.table_blocks}-max{max(self.lens)}")


def make_layer(spec: BlockSpec, num_blocks: int, device: torch.device, seed: int):
    """Random pool; returns (pool, k_cache, v_cache) with the caches as views of layer `LAYER`."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(spec.pool_shape(num_blocks), generator=gen).to(spec.torch_dtype)
    pool = pool.to(device)
    k_cache, v_cache = pool[:, LAYER, 0], pool[:, LAYER, 1]
    assert not k_cache.is_contiguous()
    return pool, k_cache, v_cache


def make_block_tables(lens: tuple[int, ...], block_size: int, table_blocks: int, num_blocks: int,
                      seed: int) -> torch.Tensor:
    """Distinct shuffled block ids per sequence; entries past a sequence's length hold `PAD_BLOCK_ID`."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), table_blocks), PAD_BLOCK_ID, dtype=torch.int32)
    used = 0
    for i, seq_len in enumerate(lens):
        n = -(-seq_len // block_size)
        table[i, :n] = ids[used : used + n]
        used += n
    return table


def run_decode(case: Case, device: torch.device, *, dtype: str = "float32", seed: int = 0):
    """(triton, reference) outputs for one case."""
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                     block_size_tokens=case.block_size, dtype=dtype)
    num_blocks = sum(-(-n // case.block_size) for n in case.lens) + 5
    _, k_cache, v_cache = make_layer(spec, num_blocks, device, seed)
    tables = make_block_tables(case.lens, case.block_size, case.table_blocks, num_blocks, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(case.lens), case.group * case.num_kv_heads, case.head_dim, generator=gen)
    q = q.to(spec.torch_dtype).to(device)
    seq_lens = torch.tensor(case.lens, dtype=torch.int32, device=device)
    scale = case.head_dim**-0.5
    got = ta.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=scale)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=scale)
    return got, want


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got.float() - want.float()).abs().max().item()


# Spread over batch 1-8, lengths 1-300 around block edges, group 1/4/8, head_dim 64/80/96/128,
# block 16/32/64; table widths give 1 to 3 splits (256 tokens each), so some splits are empty.
DECODE_CASES = [
    Case(lens=(1,), group=1, num_kv_heads=2, head_dim=64, block_size=16, table_blocks=1),
    Case(lens=(300, 17, 33), group=4, num_kv_heads=2, head_dim=128, block_size=16, table_blocks=19),
    Case(lens=(1, 15, 16, 17, 31, 32, 33, 300), group=8, num_kv_heads=1, head_dim=64, block_size=32,
         table_blocks=10),
    Case(lens=(64, 257), group=4, num_kv_heads=2, head_dim=80, block_size=16, table_blocks=40),
    Case(lens=(100, 5, 229), group=8, num_kv_heads=2, head_dim=96, block_size=32, table_blocks=8),
    Case(lens=(2, 48, 160, 255), group=1, num_kv_heads=4, head_dim=128, block_size=32, table_blocks=8),
    Case(lens=(63, 64, 65, 200), group=4, num_kv_heads=2, head_dim=64, block_size=64, table_blocks=5),
    Case(lens=(7, 256, 129, 290, 1), group=1, num_kv_heads=3, head_dim=64, block_size=16, table_blocks=20),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_matches_reference_fp32(case, kernel_device):
    got, want = run_decode(case, kernel_device)
    assert max_err(got, want) <= 1e-5


def test_decode_long_sequence_many_splits(kernel_device):
    case = Case(lens=(1000, 700), group=4, num_kv_heads=1, head_dim=64, block_size=16, table_blocks=63)
    assert ta.decode_num_splits(63 * 16) == 4
    got, want = run_decode(case, kernel_device)
    assert max_err(got, want) <= 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_half_precision(dtype, kernel_device):
    case = Case(lens=(1, 90, 300), group=4, num_kv_heads=2, head_dim=64, block_size=16, table_blocks=19)
    got, want = run_decode(case, kernel_device, dtype=dtype)
    assert max_err(got, want) <= 2e-2


def test_decode_int64_indices_and_strided_q(kernel_device):
    case_lens, hkv, group, d, b = (40, 3), 2, 4, 64, 16
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=hkv, head_dim=d, block_size_tokens=b)
    _, k_cache, v_cache = make_layer(spec, 8, kernel_device, seed=3)
    tables = make_block_tables(case_lens, b, 3, 8, seed=3).long().to(kernel_device)
    qkv = torch.randn(2, hkv * group + 2 * hkv, d).to(kernel_device)
    q = qkv[:, : hkv * group]  # strided over sequences, as sliced out of a fused qkv projection
    seq_lens = torch.tensor(case_lens, dtype=torch.int64, device=kernel_device)
    got = ta.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.3)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.3)
    assert max_err(got, want) <= 1e-5


def test_num_splits_heuristic():
    assert [ta.decode_num_splits(t) for t in (1, 256, 257, 1024, 8192, 10**6)] == [1, 1, 2, 4, 32, 32]


def run_write(spec: BlockSpec, device: torch.device, key_dtype: torch.dtype, slot_dtype: torch.dtype):
    """Writes the same tokens with both implementations into two copies of a pool; returns both pools."""
    num_blocks = 6
    pool, k_cache, v_cache = make_layer(spec, num_blocks, device, seed=5)
    want_pool = pool.clone()
    b = spec.block_size_tokens
    # block edges, skipped padding, and a non-contiguous key/value sliced from a fused kv tensor
    slots = torch.tensor([0, b - 1, b, -1, 3 * b + 5, num_blocks * b - 1, -7, 2 * b + 1], dtype=slot_dtype)
    kv = torch.randn(len(slots), 2, spec.num_kv_heads, spec.head_dim).to(key_dtype)
    key, value = kv[:, 0], kv[:, 1]
    ta.write_kv(k_cache, v_cache, key.to(device), value.to(device), slots.to(device))
    reference.write_kv(want_pool[:, LAYER, 0], want_pool[:, LAYER, 1], key.to(device), value.to(device),
                       slots.to(device))
    return pool, want_pool


@pytest.mark.parametrize(
    ("cache_dtype", "key_dtype", "slot_dtype", "head_dim", "block_size"),
    [
        ("float32", torch.float32, torch.int64, 64, 16),
        ("float32", torch.float32, torch.int32, 80, 32),
        ("bfloat16", torch.bfloat16, torch.int64, 128, 16),
        ("float16", torch.float32, torch.int64, 96, 64),  # fp32 -> fp16 rounds to nearest even
    ],
)
def test_write_kv_matches_reference_exactly(cache_dtype, key_dtype, slot_dtype, head_dim, block_size,
                                            kernel_device):
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=3, head_dim=head_dim, block_size_tokens=block_size,
                     dtype=cache_dtype)
    pool, want_pool = run_write(spec, kernel_device, key_dtype, slot_dtype)
    assert torch.equal(pool, want_pool)


def test_write_kv_negative_slots_write_nothing(kernel_device):
    spec = BlockSpec(num_layers=1, num_kv_heads=2, head_dim=64)
    pool = spec.new_pool(2, device=kernel_device)
    key = torch.ones(3, 2, 64, device=kernel_device)
    ta.write_kv(pool[:, 0, 0], pool[:, 0, 1], key, -key, torch.tensor([-1, 17, -1], device=kernel_device))
    written = (pool != 0).nonzero().tolist()  # [block, layer, k|v, head, row, dim]
    assert sorted({(b, kv, h, r) for b, _, kv, h, r, _ in written}) == [
        (1, 0, 0, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 1)]


def _decode_args(device: torch.device) -> dict:
    spec = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=64)
    pool = spec.new_pool(4, device=device)
    return dict(q=torch.zeros(2, 4, 64, device=device), k_cache=pool[:, 0, 0], v_cache=pool[:, 0, 1],
                block_tables=torch.zeros(2, 4, dtype=torch.int32, device=device),
                seq_lens=torch.ones(2, dtype=torch.int32, device=device))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(q=a["q"].long()), r"q\.dtype is torch\.int64"),
        (lambda a: a.update(q=a["q"][:, :3]), r"q has 3 heads, not a multiple of the cache's 2 KV heads"),
        (lambda a: a.update(q=a["q"][..., :32]), r"q head_dim 32 != cache head_dim 64"),
        (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), r"q must be contiguous"),
        (lambda a: a.update(k_cache=a["k_cache"][0]), r"k_cache must be 4-D"),
        (lambda a: a.update(v_cache=a["v_cache"].half()), r"k_cache\.dtype torch\.float32 != v_cache\.dtype"),
        (lambda a: a.update(block_tables=a["block_tables"].float()), r"block_tables must be 2-D int32/int64"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens 1 must equal q's 2 sequences"),
    ],
)
def test_decode_launcher_rejects(change, message, kernel_device):
    args = _decode_args(kernel_device)
    change(args)
    with pytest.raises(ValueError, match=message):
        ta.paged_decode_attention(**args, scale=1.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(key=a["key"][:, :1]), r"key shape \(3, 1, 64\) does not fit the cache"),
        (lambda a: a.update(value=a["value"].int()), r"value\.dtype is torch\.int32"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), r"slot_mapping must be 1-D int32/int64"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), r"slot_mapping has 2 slots for 3 tokens"),
    ],
)
def test_write_kv_launcher_rejects(change, message, kernel_device):
    d = _decode_args(kernel_device)
    args = dict(k_cache=d["k_cache"], v_cache=d["v_cache"], key=torch.zeros(3, 2, 64, device=kernel_device),
                value=torch.zeros(3, 2, 64, device=kernel_device),
                slot_mapping=torch.arange(3, device=kernel_device))
    change(args)
    with pytest.raises(ValueError, match=message):
        ta.write_kv(**args)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_decode_sweep(group, head_dim, block_size, kernel_device):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    lens = tuple(torch.randint(1, 600, (4,), generator=gen).tolist()) + (1, block_size, block_size + 1)
    case = Case(lens=lens, group=group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                table_blocks=-(-600 // block_size) + 1)
    got, want = run_decode(case, kernel_device)
    assert max_err(got, want) <= 1e-5


# --- compiled on CUDA -------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


GPU_CASES = [
    Case(lens=(1, 17, 1000, 3000, 4097, 250, 64, 2048), group=4, num_kv_heads=8, head_dim=128, block_size=16,
         table_blocks=300),
    Case(lens=(5, 777, 1500), group=8, num_kv_heads=2, head_dim=64, block_size=32, table_blocks=60),
    Case(lens=(300, 9000), group=1, num_kv_heads=4, head_dim=80, block_size=64, table_blocks=150),
    Case(lens=(33, 1234), group=4, num_kv_heads=2, head_dim=96, block_size=16, table_blocks=90),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_gpu_decode_matches_reference(case, dtype, tolerance, no_tf32):
    got, want = run_decode(case, torch.device("cuda"), dtype=dtype)
    assert max_err(got, want) <= tolerance


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("cache_dtype", "key_dtype"),
                         [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("bfloat16", torch.float32)])
def test_gpu_write_kv_matches_reference_exactly(cache_dtype, key_dtype):
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=8, head_dim=128, dtype=cache_dtype)
    pool, want_pool = run_write(spec, torch.device("cuda"), key_dtype, torch.int64)
    assert torch.equal(pool, want_pool)
