"""The unified Triton attention kernel against `kernels.reference.prefill_attention`.

On CPU it runs under ``TRITON_INTERPRET=1`` (set by this folder's conftest); with CUDA it runs compiled.
Each batch mixes prefill chunks with and without a cached prefix (prefixes off block edges, chunks that
span blocks), decode tokens (one query) and sequences with no queries. KV lives in non-contiguous layer
views of a real pool, block tables hold shuffled block ids padded with ids that must never be read, and
the unwritten rows past each sequence's end in its last block hold NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kvrelay.kernels import reference
from kvrelay.kernels import triton_unified as tu
from kvrelay.kvstore.block_spec import BlockSpec

NUM_LAYERS = 2
LAYER = 1
PAD_BLOCK_ID = 1 << 20  # far past the pool: reading it would fault or give garbage
# Max abs error of float32 outputs. Token weights take the same bound relative to the largest weight
# (`weights_rel_err`): a key's weight sums up to num_queries x group softmax terms, so float32 rounding alone
# exceeds 1e-5 absolute once weights pass ~30.
FP32_TOLERANCE = 1e-5
# bf16/fp16 outputs: P is rounded to the input dtype before P @ V on the GPU, as in flash attention.
HALF_TOLERANCE = 2e-2
# Token weights from half inputs (relative): scores are exact products summed in float32 on both sides.
HALF_WEIGHTS_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Case:
    """One batch: ``seqs`` holds (cached prefix tokens, new tokens) per sequence."""

    seqs: tuple[tuple[int, int], ...]
    group: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def seq_lens(self) -> list[int]:
        return [ctx + new for ctx, new in self.seqs]

    def __str__(self) -> str:
        return (f"n{len(self.seqs)}-g{self.group}-kv{self.num_kv_heads}-d{self.head_dim}-b{self.block_size}"
                f"-q{sum(new for _, new in self.seqs)}-max{max(self.seq_lens)}")


@dataclass(frozen=True)
class Batch:
    """Kernel inputs for one `Case`."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)

    def new_weights(self, width: int | None = None) -> torch.Tensor:
        """A token-weight buffer filled with garbage that must be overwritten."""
        width = max(self.seq_lens.tolist(), default=0) if width is None else width
        return torch.full((self.seq_lens.shape[0], self.k_cache.shape[1], width), 7.0, device=self.q.device)


def make_batch(case: Case, device: torch.device, *, dtype: str = "float32", seed: int = 0) -> Batch:
    """Random KV in layer `LAYER` of a pool (NaN past each sequence's end) and shuffled, padded block tables."""
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                     block_size_tokens=case.block_size, dtype=dtype)
    blocks_per_seq = [-(-n // case.block_size) for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(spec.pool_shape(num_blocks), generator=gen).to(spec.torch_dtype).to(device)
    k_cache, v_cache = pool[:, LAYER, 0], pool[:, LAYER, 1]
    assert not k_cache.is_contiguous()
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(case.seqs), max(blocks_per_seq) + 1), PAD_BLOCK_ID, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = ids[used : used + n]
        used += n
        if n:
            tail = case.seq_lens[i] - (n - 1) * case.block_size
            pool[table[i, n - 1].item(), LAYER, :, :, tail:] = float("nan")
    counts = [new for _, new in case.seqs]
    query_start_loc = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(counts), case.group * case.num_kv_heads, case.head_dim, generator=gen)
    return Batch(q=q.to(spec.torch_dtype).to(device), k_cache=k_cache, v_cache=v_cache, block_tables=table.to(device),
                 seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
                 query_start_loc=query_start_loc.to(device), scale=case.head_dim**-0.5)


def compare(batch: Batch) -> tuple[float, float]:
    """(max abs error of the output, `weights_rel_err`) of the kernel against the reference."""
    got_w, want_w = batch.new_weights(), batch.new_weights()
    got = tu.unified_attention(*batch.args(), scale=batch.scale, token_weights=got_w)
    want = reference.prefill_attention(*batch.args(), scale=batch.scale, token_weights=want_w)
    return max_err(got, want), weights_rel_err(got_w, want_w)


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def weights_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error of token weights over max(1, the largest weight)."""
    return max_err(got, want) / max(1.0, want.abs().max().item() if want.numel() else 0.0)


# (prefix, new): fresh prefills, prefixes off block edges with chunks across them, decode tokens, 0 queries.
# Every block size and GQA ratio appears; query counts give several query tiles per sequence
# (BLOCK_Q is 64 / next_pow2(group): 64, 32, 16, 16, 8).
CASES = [
    Case(seqs=((0, 70), (21, 5), (40, 1), (10, 0), (0, 1), (37, 30)), group=1, num_kv_heads=2, head_dim=64,
         block_size=16),
    Case(seqs=((0, 40), (45, 23), (100, 1), (0, 0), (63, 2)), group=2, num_kv_heads=2, head_dim=64, block_size=32),
    Case(seqs=((0, 33), (50, 30), (127, 1), (64, 1), (5, 0)), group=3, num_kv_heads=3, head_dim=64, block_size=64),
    Case(seqs=((17, 20), (0, 1), (0, 18), (90, 1), (31, 3)), group=4, num_kv_heads=2, head_dim=80, block_size=16),
    Case(seqs=((0, 20), (33, 11), (70, 1), (1, 1), (0, 0)), group=8, num_kv_heads=1, head_dim=128, block_size=32),
    Case(seqs=((60, 9), (0, 24), (129, 1)), group=4, num_kv_heads=1, head_dim=96, block_size=64),
    Case(seqs=((3, 17), (0, 1), (47, 2)), group=3, num_kv_heads=1, head_dim=128, block_size=16),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_fp32(case, kernel_device):
    out_err, weights_err = compare(make_batch(case, kernel_device))
    assert out_err <= FP32_TOLERANCE
    assert weights_err <= FP32_TOLERANCE


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_block_sizes_and_groups(block_size, group, kernel_device):
    b = block_size
    # (65, 70): key tile 128 is first seen by query 63, the last of a query tile for every BLOCK_Q.
    seqs = ((0, 2 * b + 3), (b + 5, b), (3 * b - 1, 1), (b // 2, 0), (0, 1), (b - 1, 2), (65, 70))
    out_err, weights_err = compare(make_batch(Case(seqs=seqs, group=group, num_kv_heads=2, head_dim=64,
                                                   block_size=b), kernel_device, seed=block_size + group))
    assert out_err <= FP32_TOLERANCE
    assert weights_err <= FP32_TOLERANCE


def test_long_chunks(kernel_device):
    """Hundreds of queries per sequence: many query tiles, each looping over many KV tiles."""
    case = Case(seqs=((200, 150), (0, 300), (511, 1), (77, 64)), group=4, num_kv_heads=2, head_dim=128,
                block_size=16)
    out_err, weights_err = compare(make_batch(case, kernel_device))
    assert out_err <= FP32_TOLERANCE
    assert weights_err <= FP32_TOLERANCE


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype, kernel_device):
    case = Case(seqs=((0, 20), (45, 7), (90, 1)), group=4, num_kv_heads=2, head_dim=64, block_size=16)
    out_err, weights_err = compare(make_batch(case, kernel_device, dtype=dtype))
    assert out_err <= HALF_TOLERANCE
    assert weights_err <= HALF_WEIGHTS_TOLERANCE


def test_output_does_not_depend_on_token_weights(kernel_device):
    batch = make_batch(CASES[3], kernel_device)
    plain = tu.unified_attention(*batch.args(), scale=batch.scale)
    with_weights = tu.unified_attention(*batch.args(), scale=batch.scale, token_weights=batch.new_weights())
    assert torch.equal(plain, with_weights)


def test_decode_only_batch_matches_decode_reference(kernel_device):
    """One query per sequence is decode: same as `reference.paged_decode_attention`, weights included."""
    case = Case(seqs=((0, 1), (15, 1), (16, 1), (80, 1), (200, 1)), group=4, num_kv_heads=2, head_dim=64,
                block_size=16)
    batch = make_batch(case, kernel_device)
    batch.k_cache.nan_to_num_(0.0)  # the decode reference reads whole blocks (masked rows times 0 would be NaN)
    batch.v_cache.nan_to_num_(0.0)
    got_w, want_w = batch.new_weights(), batch.new_weights()
    got = tu.unified_attention(*batch.args(), scale=batch.scale, token_weights=got_w)
    want = reference.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                            batch.seq_lens, scale=batch.scale, token_weights=want_w)
    assert max_err(got, want) <= FP32_TOLERANCE
    assert weights_rel_err(got_w, want_w) <= FP32_TOLERANCE


def test_no_queries_at_all_zeroes_weights(kernel_device):
    case = Case(seqs=((30, 0), (5, 0)), group=2, num_kv_heads=2, head_dim=64, block_size=16)
    batch = make_batch(case, kernel_device)
    weights = batch.new_weights()
    out = tu.unified_attention(*batch.args(), scale=batch.scale, token_weights=weights)
    assert out.shape == (0, 4, 64)
    assert torch.equal(weights, torch.zeros_like(weights))


def test_zero_query_sequence_weights_are_zero_and_wide_buffer_zero_past_seq_len(kernel_device):
    case = Case(seqs=((20, 3), (40, 0), (0, 5)), group=2, num_kv_heads=2, head_dim=64, block_size=16)
    batch = make_batch(case, kernel_device)
    width = batch.block_tables.shape[1] * case.block_size + 70  # wider than any sequence and the table
    got_w, want_w = batch.new_weights(width), batch.new_weights(width)
    tu.unified_attention(*batch.args(), scale=batch.scale, token_weights=got_w)
    reference.prefill_attention(*batch.args(), scale=batch.scale, token_weights=want_w)
    assert weights_rel_err(got_w, want_w) <= FP32_TOLERANCE
    assert torch.equal(got_w[1], torch.zeros_like(got_w[1]))
    assert torch.equal(got_w[0, :, 23:], torch.zeros_like(got_w[0, :, 23:]))
    # each row sums to num_queries * group
    sums = got_w.sum(dim=2)
    assert torch.allclose(sums, torch.tensor([[6.0, 6.0], [0.0, 0.0], [10.0, 10.0]], device=sums.device))


def test_int64_indices_strided_q_and_trailing_tokens(kernel_device):
    """q sliced from a fused qkv tensor; int64 tables, lengths and offsets; q rows past the last sequence."""
    case = Case(seqs=((9, 12), (0, 1), (33, 4)), group=2, num_kv_heads=2, head_dim=64, block_size=32)
    batch = make_batch(case, kernel_device)
    hq, d = 4, 64
    qkv = torch.randn(batch.q.shape[0] + 2, hq + 2 * 2, d, device=kernel_device)
    q = qkv[:, :hq]  # strided over tokens; the 2 trailing rows belong to no sequence
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables.long(), batch.seq_lens.long(),
            batch.query_start_loc.long())
    got_w, want_w = batch.new_weights(), batch.new_weights()  # narrower than the table: checked with a sync
    got = tu.unified_attention(*args, scale=0.3, token_weights=got_w)
    want = reference.prefill_attention(*args, scale=0.3, token_weights=want_w)
    assert max_err(got[:-2], want[:-2]) <= FP32_TOLERANCE
    assert weights_rel_err(got_w, want_w) <= FP32_TOLERANCE


def test_query_tile_shape():
    assert [tu.query_tile_shape(g * 2, 2) for g in (1, 2, 3, 4, 8, 16, 64, 128)] == [
        (64, 1), (32, 2), (16, 4), (16, 4), (8, 8), (4, 16), (1, 64), (1, 128)]


def _args(device: torch.device) -> dict:
    spec = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=64)
    pool = spec.new_pool(4, device=device)
    return dict(q=torch.zeros(3, 4, 64, device=device), k_cache=pool[:, 0, 0], v_cache=pool[:, 0, 1],
                block_tables=torch.zeros(2, 4, dtype=torch.int32, device=device),
                seq_lens=torch.tensor([2, 1], dtype=torch.int32, device=device),
                query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32, device=device))


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
        (lambda a: a.update(block_tables=a["block_tables"][:1]), r"block_tables has 1 rows for 2 sequences"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:, None]), r"seq_lens must be 1-D int32/int64"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:2]),
         r"query_start_loc has 2 entries; expected N \+ 1 = 3"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].float()), r"query_start_loc must be 1-D int32"),
        (lambda a: a.update(token_weights=torch.zeros(2, 2, 8, dtype=torch.float64)),
         r"token_weights\.dtype is torch\.float64"),
        (lambda a: a.update(token_weights=torch.zeros(2, 4, 8)), r"token_weights shape \(2, 4, 8\) does not fit"),
        (lambda a: a.update(token_weights=torch.zeros(2, 2, 1)), r"token_weights is too narrow: width 1 < max"),
    ],
)
def test_launcher_rejects(change, message, kernel_device):
    args = _args(kernel_device)
    change(args)
    if "token_weights" in args:
        args["token_weights"] = args["token_weights"].to(kernel_device)
    with pytest.raises(ValueError, match=message):
        tu.unified_attention(**args, scale=1.0)


# --- compiled on CUDA -------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_CASES = [
    # A step of a Llama-8B-shaped layer: a chunk after an 8k prefix, a fresh prefill, decodes, an idle sequence.
    Case(seqs=((8000, 192), (0, 512), (8191, 1), (3000, 1), (17, 1), (4000, 0), (1234, 77)), group=4,
         num_kv_heads=8, head_dim=128, block_size=16),
    Case(seqs=((0, 1000), (555, 333), (2047, 1)), group=3, num_kv_heads=3, head_dim=64, block_size=64),
    Case(seqs=((100, 300), (4097, 1), (0, 1)), group=8, num_kv_heads=2, head_dim=80, block_size=32),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize(
    ("dtype", "tolerance", "weights_tolerance"),
    [("float32", FP32_TOLERANCE, FP32_TOLERANCE), ("bfloat16", HALF_TOLERANCE, HALF_WEIGHTS_TOLERANCE)],
)
def test_gpu_matches_reference(case, dtype, tolerance, weights_tolerance, no_tf32):
    out_err, weights_err = compare(make_batch(case, torch.device("cuda"), dtype=dtype))
    assert out_err <= tolerance
    assert weights_err <= weights_tolerance
