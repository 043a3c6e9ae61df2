"""Kernels for long-context KV policies: per-token attention weights (H2O) and block selection (Quest).

The references are checked against brute force written here from the definitions (per sequence, per
head, token by token); the Triton kernels (``TRITON_INTERPRET=1`` on CPU, compiled with CUDA) are
checked against the references. KV lives in non-contiguous layer views of a real pool, and block tables
hold shuffled block ids padded with out-of-range ids that must never be read.
"""

from __future__ import annotations

import pytest
import torch
from kvrelay.kernels import reference
from kvrelay.kernels import triton_attention as ta
from kvrelay.kernels import triton_long_context as tlc
from kvrelay.kvstore.block_spec import BlockSpec

from tests.kernels.test_triton_attention import GPU_CASES, NUM_LAYERS, Case, make_block_tables, make_layer

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SENTINEL = 7.0  # pre-filled into output buffers: every position must be overwritten


def decode_inputs(case: Case, device: torch.device, *, dtype: str = "float32", seed: int = 0) -> dict:
    """Keyword arguments of ``paged_decode_attention`` (without ``scale``) for one case."""
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                     block_size_tokens=case.block_size, dtype=dtype)
    num_blocks = sum(-(-n // case.block_size) for n in case.lens) + 3
    _, k_cache, v_cache = make_layer(spec, num_blocks, device, seed)
    tables = make_block_tables(case.lens, case.block_size, case.table_blocks, num_blocks, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(case.lens), case.group * case.num_kv_heads, case.head_dim, generator=gen)
    return dict(q=q.to(spec.torch_dtype).to(device), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=torch.tensor(case.lens, dtype=torch.int32, device=device))


def new_weights(num_seqs: int, num_kv_heads: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.full((num_seqs, num_kv_heads, width), SENTINEL, dtype=torch.float32, device=device)


def token_keys(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Token by token: position p is row p % B of block table[p // B]. ``[seq_len, H, D]`` float64."""
    b = cache.shape[2]
    return torch.stack([cache[int(table[p // b]), :, p % b] for p in range(seq_len)]).double()


def brute_attention_weights(q: torch.Tensor, keys: torch.Tensor, scale: float, positions: list[int]) -> torch.Tensor:
    """Query row t (at position positions[t]) sees keys 0..positions[t]; softmax per query head, summed
    over the queries and over each KV group's heads. q ``[T, Hq, D]``, keys ``[S, Hkv, D]`` → ``[Hkv, S]``."""
    num_q_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_kv_heads, keys.shape[0], dtype=torch.float64)
    for t, pos in enumerate(positions):
        for h in range(num_q_heads):
            logits = keys[: pos + 1, h // group] @ q[t, h].double() * scale
            out[h // group, : pos + 1] += torch.softmax(logits, dim=0)
    return out


def brute_decode_weights(args: dict, scale: float, width: int) -> torch.Tensor:
    lens = args["seq_lens"].tolist()
    want = torch.zeros(len(lens), args["k_cache"].shape[1], width, dtype=torch.float64)
    for i, seq_len in enumerate(lens):
        keys = token_keys(args["k_cache"].cpu(), args["block_tables"][i].cpu(), seq_len)
        want[i, :, :seq_len] = brute_attention_weights(args["q"][i : i + 1].cpu(), keys, scale, [seq_len - 1])
    return want


# --- reference: per-token weights ------------------------------------------------------------------

REFERENCE_DECODE_CASES = [
    Case(lens=(1, 16, 37), group=1, num_kv_heads=2, head_dim=64, block_size=16, table_blocks=4),
    Case(lens=(64, 5, 90), group=4, num_kv_heads=2, head_dim=80, block_size=32, table_blocks=4),
]


@pytest.mark.parametrize("case", REFERENCE_DECODE_CASES, ids=str)
def test_reference_decode_weights_match_brute_force(case):
    args = decode_inputs(case, torch.device("cpu"))
    scale, width = case.head_dim**-0.5, max(case.lens) + case.block_size + 3  # past the last block too
    weights = new_weights(len(case.lens), case.num_kv_heads, width, torch.device("cpu"))
    out = reference.paged_decode_attention(**args, scale=scale, token_weights=weights)

    assert torch.equal(out, reference.paged_decode_attention(**args, scale=scale))
    torch.testing.assert_close(weights.double(), brute_decode_weights(args, scale, width), rtol=0, atol=1e-6)
    for i, seq_len in enumerate(case.lens):
        assert torch.equal(weights[i, :, seq_len:], torch.zeros_like(weights[i, :, seq_len:]))
        # each query head's weights sum to 1, so a KV head's row sums to its group size
        torch.testing.assert_close(weights[i].sum(dim=1), torch.full((case.num_kv_heads,), float(case.group)))


def test_reference_prefill_weights_match_brute_force():
    # cached prefix + new tokens; sequence 1 has no queries this step, sequence 2 is a fresh prefill
    lens, num_queries, hkv, group, d, b = (40, 20, 9), (6, 0, 9), 2, 4, 64, 16
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=hkv, head_dim=d, block_size_tokens=b)
    _, k_cache, v_cache = make_layer(spec, 10, torch.device("cpu"), seed=4)
    tables = make_block_tables(lens, b, 3, 10, seed=4)
    q = torch.randn(sum(num_queries), hkv * group, d, generator=torch.Generator().manual_seed(5))
    starts = torch.tensor([0, 6, 6, 15], dtype=torch.int32)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=starts)
    width, scale = 45, d**-0.5
    weights = new_weights(3, hkv, width, torch.device("cpu"))
    out = reference.prefill_attention(**args, scale=scale, token_weights=weights)

    assert torch.equal(out, reference.prefill_attention(**args, scale=scale))
    want = torch.zeros(3, hkv, width, dtype=torch.float64)
    for i, (seq_len, n) in enumerate(zip(lens, num_queries)):
        keys = token_keys(k_cache, tables[i], seq_len)
        positions = list(range(seq_len - n, seq_len))
        want[i, :, :seq_len] = brute_attention_weights(q[int(starts[i]) : int(starts[i + 1])], keys, scale, positions)
    torch.testing.assert_close(weights.double(), want, rtol=0, atol=1e-6)
    # every query head's weights sum to 1: a KV head's total is queries x group
    torch.testing.assert_close(weights.sum(dim=2), torch.tensor([[24.0] * hkv, [0.0] * hkv, [36.0] * hkv]))
    assert torch.equal(weights[1], torch.zeros(hkv, width))
    assert torch.equal(weights[0, :, 40:], torch.zeros(hkv, 5))


# --- reference: block summaries and scores ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_block_key_summaries(dtype):
    spec = BlockSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size_tokens=16, dtype=dtype)
    pool, _, _ = make_layer(spec, 6, torch.device("cpu"), seed=6)
    ids = torch.tensor([4, 0, 4, 5])
    got = reference.block_key_summaries(pool, ids)
    assert got.shape == (4, 2, 3, 2, 64) and got.dtype == torch.float32
    for i, block in enumerate(ids.tolist()):
        keys = pool[block, :, 0].float()  # [L, Hkv, B, D]; values (index 1) must not count
        assert torch.equal(got[i, :, :, 0], torch.amin(keys, dim=2))
        assert torch.equal(got[i, :, :, 1], torch.amax(keys, dim=2))


def brute_scores(q: torch.Tensor, summaries: torch.Tensor, cand_rows: torch.Tensor, scale: float) -> torch.Tensor:
    num_cands, num_kv_heads = summaries.shape[:2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(num_cands, num_kv_heads, dtype=torch.float64)
    for c in range(num_cands):
        for g in range(num_kv_heads):
            lo, hi = summaries[c, g, 0].double(), summaries[c, g, 1].double()
            for h in range(g * group, (g + 1) * group):
                qh = q[int(cand_rows[c]), h].double()
                out[c, g] += scale * sum(max(qh[d] * lo[d], qh[d] * hi[d]) for d in range(q.shape[2]))
    return out


def scoring_inputs(device: torch.device, *, group: int, head_dim: int, block_size: int = 16, seed: int = 7):
    """(pool, q, block_ids, cand_rows): 3 sequences, 5 candidate blocks, 2 KV heads."""
    spec = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=head_dim, block_size_tokens=block_size)
    pool, _, _ = make_layer(spec, 8, device, seed)
    q = torch.randn(3, 2 * group, head_dim, generator=torch.Generator().manual_seed(seed)).to(device)
    block_ids = torch.tensor([6, 1, 3, 0, 7], device=device)
    cand_rows = torch.tensor([0, 0, 2, 1, 2], device=device)
    return pool, q, block_ids, cand_rows


def test_reference_score_blocks_matches_brute_force():
    pool, q, block_ids, cand_rows = scoring_inputs(torch.device("cpu"), group=4, head_dim=16)
    summaries = reference.block_key_summaries(pool, block_ids)[:, 1]
    got = reference.score_blocks(q, summaries, cand_rows, scale=0.25)
    assert got.shape == (5, 2) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), brute_scores(q, summaries, cand_rows, 0.25), rtol=1e-6, atol=1e-6)
    empty = reference.score_blocks(q, summaries[:0], cand_rows[:0], scale=0.25)
    assert empty.shape == (0, 2) and empty.dtype == torch.float32


@pytest.mark.parametrize("backend", [reference, tlc], ids=["reference", "triton"])
def test_score_bounds_every_heads_largest_logit(backend, kernel_device):
    pool, q, block_ids, cand_rows = scoring_inputs(kernel_device, group=4, head_dim=64)
    pool[7, 1, 0, 1] = pool[7, 1, 0, 1, 3].clone()  # block 7 (candidate 4), layer 1, KV head 1: one key repeated
    layer, scale, group = 1, 0.125, 4
    scores = backend.score_blocks(q, backend.block_key_summaries(pool, block_ids)[:, layer], cand_rows, scale=scale)
    for c, (block, row) in enumerate(zip(block_ids.tolist(), cand_rows.tolist())):
        for g in range(2):
            keys = pool[block, layer, 0, g].double()  # [B, D]
            logits = q[row, g * group : (g + 1) * group].double() @ keys.T * scale  # [group, B]
            largest = logits.max(dim=1).values.sum().item()
            assert scores[c, g].item() >= largest - 1e-4, (c, g)
    # min == max: the bound is tight
    repeated = q[2, 4:8].double() @ pool[7, 1, 0, 1, 0].double() * scale
    assert scores[4, 1].item() == pytest.approx(repeated.sum().item(), abs=1e-4)


# --- Triton against the reference ------------------------------------------------------------------

# batch 1-5, lengths 1-200 with block multiples, group 1/4, head_dim 64/80, block 16/32; the last case
# has a 2-split table (capacity 320 tokens) with a sequence spanning both splits.
TRITON_DECODE_CASES = [
    Case(lens=(1,), group=1, num_kv_heads=2, head_dim=64, block_size=16, table_blocks=1),
    Case(lens=(200, 17, 32, 5, 1), group=4, num_kv_heads=2, head_dim=80, block_size=32, table_blocks=8),
    Case(lens=(48, 130, 3), group=1, num_kv_heads=3, head_dim=64, block_size=16, table_blocks=10),
    Case(lens=(270, 64), group=4, num_kv_heads=1, head_dim=64, block_size=16, table_blocks=20),
]


def compare_decode_weights(case: Case, device: torch.device, *, width: int, dtype: str = "float32",
                           tolerance: float = 1e-5, weight_tolerance: float = 1e-5) -> None:
    args = decode_inputs(case, device, dtype=dtype)
    scale, n, hkv = case.head_dim**-0.5, len(case.lens), case.num_kv_heads
    got_w, want_w = new_weights(n, hkv, width, device), new_weights(n, hkv, width, device)
    got = ta.paged_decode_attention(**args, scale=scale, token_weights=got_w)
    want = reference.paged_decode_attention(**args, scale=scale, token_weights=want_w)
    without = ta.paged_decode_attention(**args, scale=scale)
    if device.type == "cpu":  # compiled, the extra logit stores may change how the compiler fuses float ops
        assert torch.equal(got, without)
    assert (got.float() - without.float()).abs().max().item() <= tolerance
    assert (got.float() - want.float()).abs().max().item() <= tolerance
    assert (got_w - want_w).abs().max().item() <= weight_tolerance
    for i, seq_len in enumerate(case.lens):
        assert torch.equal(got_w[i, :, seq_len:], torch.zeros_like(got_w[i, :, seq_len:]))


@pytest.mark.parametrize("case", TRITON_DECODE_CASES, ids=str)
def test_triton_decode_weights_match_reference(case, kernel_device):
    # narrowest allowed width (max seq_len) and one past the block-table capacity
    for width in (max(case.lens), case.table_blocks * case.block_size + 7):
        compare_decode_weights(case, kernel_device, width=width)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "strided"),
    [("float32", 64, 16, False), ("bfloat16", 80, 32, True), ("float16", 96, 64, False)],
)
def test_triton_block_key_summaries_equal_reference(dtype, head_dim, block_size, strided, kernel_device):
    spec = BlockSpec(num_layers=2, num_kv_heads=4 if strided else 2, head_dim=head_dim,
                     block_size_tokens=block_size, dtype=dtype)
    pool, _, _ = make_layer(spec, 5, kernel_device, seed=8)
    if strided:
        pool = pool[:, :, :, 1:3]  # two of four KV heads: a non-contiguous pool
    ids = torch.tensor([3, 0, 4], dtype=torch.int32, device=kernel_device)
    got = tlc.block_key_summaries(pool, ids)
    assert torch.equal(got, reference.block_key_summaries(pool, ids))
    assert tlc.block_key_summaries(pool, ids[:0]).shape == (0, 2, 2, 2, head_dim)


@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (4, 80), (8, 16)])
def test_triton_score_blocks_match_reference(group, head_dim, kernel_device):
    pool, q, block_ids, cand_rows = scoring_inputs(kernel_device, group=group, head_dim=head_dim)
    summaries = reference.block_key_summaries(pool, block_ids)[:, 0]
    got = tlc.score_blocks(q, summaries, cand_rows.int(), scale=head_dim**-0.5)
    want = reference.score_blocks(q, summaries, cand_rows, scale=head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert tlc.score_blocks(q, summaries[:0], cand_rows[:0], scale=1.0).shape == (0, 2)


# --- bad input -------------------------------------------------------------------------------------


def small_decode_args(device: torch.device) -> dict:
    case = Case(lens=(5, 3), group=2, num_kv_heads=2, head_dim=64, block_size=16, table_blocks=2)
    return decode_inputs(case, device)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (lambda d: torch.zeros(2, 2, 8, dtype=torch.float64, device=d), r"token_weights\.dtype is torch\.float64"),
        (lambda d: torch.zeros(2, 2, 4, device=d), r"token_weights is too narrow: width 4 < max\(seq_lens\) 5"),
        (lambda d: torch.zeros(2, 4, 8, device=d), r"token_weights shape \(2, 4, 8\) does not fit"),
        (lambda d: torch.zeros(2, 8, device=d), r"token_weights (must be 3-D|shape \(2, 8\) does not fit)"),
    ],
)
@pytest.mark.parametrize("backend", [reference, ta], ids=["reference", "triton"])
def test_decode_rejects_bad_token_weights(weights, message, backend, kernel_device):
    args = small_decode_args(kernel_device)
    with pytest.raises(ValueError, match=message):
        backend.paged_decode_attention(**args, scale=1.0, token_weights=weights(kernel_device))


def test_prefill_rejects_narrow_token_weights():
    args = small_decode_args(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"token_weights is too narrow: width 4 < max\(seq_lens\) 5"):
        reference.prefill_attention(**args, query_start_loc=torch.tensor([0, 1, 2]), scale=1.0,
                                    token_weights=torch.zeros(2, 2, 4))


def _scoring_args(device: torch.device) -> dict:
    return dict(q=torch.zeros(2, 4, 64, device=device), summaries=torch.zeros(3, 2, 2, 64, device=device),
                cand_rows=torch.zeros(3, dtype=torch.int64, device=device))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(summaries=a["summaries"].half()), r"summaries\.dtype is torch\.float16"),
        (lambda a: a.update(summaries=a["summaries"][..., :32]), r"summaries shape \(3, 2, 2, 32\) does not fit"),
        (lambda a: a.update(q=a["q"][:, :3]), r"q has 3 heads, not a multiple of the summaries' 2 KV heads"),
        (lambda a: a.update(cand_rows=a["cand_rows"][:2]), r"cand_rows has 2 rows for 3 candidate blocks"),
        (lambda a: a.update(cand_rows=a["cand_rows"].float()), r"cand_rows must be 1-D int32/int64"),
        (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), r"q must be contiguous"),
    ],
)
def test_score_blocks_launcher_rejects(change, message, kernel_device):
    args = _scoring_args(kernel_device)
    change(args)
    with pytest.raises(ValueError, match=message):
        tlc.score_blocks(**args, scale=1.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(kv_pool=a["kv_pool"][:, 0]), r"kv_pool must be 6-D"),
        (lambda a: a.update(kv_pool=a["kv_pool"][:, :, :1]), r"kv_pool dim 2 must be 2 \(keys, values\)"),
        (lambda a: a.update(kv_pool=a["kv_pool"].int()), r"kv_pool\.dtype is torch\.int32"),
        (lambda a: a.update(block_ids=a["block_ids"].float()), r"block_ids must be 1-D int32/int64"),
    ],
)
def test_block_key_summaries_launcher_rejects(change, message, kernel_device):
    args = dict(kv_pool=BlockSpec(num_layers=2, num_kv_heads=2, head_dim=64).new_pool(3, device=kernel_device),
                block_ids=torch.tensor([0, 2], device=kernel_device))
    change(args)
    with pytest.raises(ValueError, match=message):
        tlc.block_key_summaries(**args)


# --- compiled on CUDA -------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize(("dtype", "tolerance", "weight_tolerance"),
                         [("float32", 1e-5, 1e-5), ("bfloat16", 2e-2, 1e-3)])
def test_gpu_decode_weights_match_reference(case, dtype, tolerance, weight_tolerance, no_tf32):
    compare_decode_weights(case, torch.device("cuda"), width=max(case.lens) + 5, dtype=dtype,
                           tolerance=tolerance, weight_tolerance=weight_tolerance)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_block_selection_matches_reference(dtype):
    spec = BlockSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size_tokens=16, dtype=dtype)
    pool = torch.randn(spec.pool_shape(512), device="cuda").to(spec.torch_dtype)
    gen = torch.Generator(device="cuda").manual_seed(9)
    block_ids = torch.randperm(512, device="cuda", generator=gen)[:300]
    summaries = tlc.block_key_summaries(pool, block_ids)
    assert torch.equal(summaries, reference.block_key_summaries(pool, block_ids))
    q = torch.randn(16, 32, 128, device="cuda").to(spec.torch_dtype)
    cand_rows = torch.randint(0, 16, (300,), device="cuda", generator=gen)
    got = tlc.score_blocks(q, summaries[:, 2], cand_rows, scale=128**-0.5)
    want = reference.score_blocks(q, summaries[:, 2], cand_rows, scale=128**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
