"""The C++ CPU decode and bf16 prefill attention (`kernels.cpu_attention`) against `kernels.reference`.

Ragged batches over block tables with shuffled ids and padding past each sequence's blocks, caches
that are strided slices of a whole KV pool (as the engine passes them), query groups 1/3/8; prefill chunks
over cached prefixes, across the kernel's 16-row tiles and 128-key chunks.
"""

from __future__ import annotations

import pytest
import torch
from kvrelay.kernels import cpu_attention, reference
from kvrelay.kvstore.block_spec import BlockSpec

from tests.kernels.test_torch_attention import DECODE_LENS, PREFILL_BATCHES
from tests.kernels.test_triton_attention import make_block_tables, make_layer


@pytest.fixture(scope="module")
def ext():
    built = cpu_attention.load()
    assert built is not None, "the C++ CPU decode attention did not build here (g++ and ninja are installed)"
    return built


def _inputs(lens: tuple[int, ...], dtype: str, group: int, seed: int, head_dim: int = 64):
    spec = BlockSpec(num_layers=3, num_kv_heads=2, head_dim=head_dim, block_size_tokens=16, dtype=dtype)
    num_blocks = sum(-(-n // 16) for n in lens) + 3
    pool, k_cache, v_cache = make_layer(spec, num_blocks, torch.device("cpu"), seed)
    tables = make_block_tables(lens, 16, max(-(-n // 16) for n in lens) + 2, num_blocks, seed)
    q = torch.randn(len(lens), group * 2, head_dim, generator=torch.Generator().manual_seed(seed)).to(k_cache.dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("name", sorted(DECODE_LENS))
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_equals_reference_fp32(ext, name: str, group: int) -> None:
    q, k_cache, v_cache, tables, seq_lens = _inputs(DECODE_LENS[name], "float32", group, seed=len(name))
    assert not k_cache.is_contiguous()  # a slice of the pool: blocks strided, each block contiguous
    got = cpu_attention.paged_decode_attention(ext, q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_dim", [128, 40])  # the other compiled head dim, and one sized at run time
def test_decode_equals_reference_at_other_head_dims(ext, head_dim: int) -> None:
    q, k_cache, v_cache, tables, seq_lens = _inputs(DECODE_LENS["ragged"], "float32", 3, seed=head_dim,
                                                    head_dim=head_dim)
    got = cpu_attention.paged_decode_attention(ext, q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    assert got.shape == (len(DECODE_LENS["ragged"]), 6, head_dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (1, 64), (8, 64), (3, 128), (8, 128), (3, 40)])
def test_bf16_equals_the_float32_math_rounded_once(ext, group: int, head_dim: int) -> None:
    """The AVX-512 bf16 passes (head dims 64 and 128: query heads in register groups of 4 and 2) and the plain
    loops (40)."""
    q, k_cache, v_cache, tables, seq_lens = _inputs(DECODE_LENS["ragged"], "bfloat16", group, seed=7,
                                                    head_dim=head_dim)
    got = cpu_attention.paged_decode_attention(ext, q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    want = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens,
                                            scale=0.125)
    assert got.dtype == torch.bfloat16
    # float32 math on the bf16 values; the only difference is the final rounding to bf16 (2^-8 relative)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize(("change", "message"), [
    ("long", "sequence 1: length 1000 does not fit its block table"),
    ("bad_block", "sequence 0: block id out of range"),
    ("empty", "sequence 0: length 0 does not fit its block table"),
    ("dtype", "k_cache dtype must equal q's"),
])
def test_bad_input_is_refused_with_a_named_reason(ext, change: str, message: str) -> None:
    q, k_cache, v_cache, tables, seq_lens = _inputs((20, 40), "float32", 1, seed=3)
    if change == "long":
        seq_lens[1] = 1000
    elif change == "bad_block":
        tables[0, 0] = 10_000
    elif change == "empty":
        seq_lens[0] = 0
    else:
        q = q.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.paged_decode_attention(ext, q, k_cache, v_cache, tables, seq_lens, scale=0.125)


def test_the_torch_backend_decodes_through_the_kernel(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.kernels import torch_attention
    from kvrelay.model.attention import TorchBackend

    monkeypatch.setattr(torch_attention, "paged_decode_attention",
                        lambda *a, **k: pytest.fail("the torch-op path ran"))
    q, k_cache, v_cache, tables, seq_lens = _inputs(DECODE_LENS["ragged"], "float32", 3, seed=11)
    got = TorchBackend().paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# (num_queries, seq_len) per sequence, besides test_torch_attention's: chunks across several 128-key chunks and
# 16-row tiles, a cold prompt of 129 tokens (one row past a tile), a one-token chunk over a long prefix.
PREFILL_LONG = [(300, 700), (129, 129), (1, 513), (17, 400)]


def _prefill_inputs(parts: list[tuple[int, int]], group: int, seed: int, head_dim: int = 64):
    lens = tuple(s for _, s in parts)
    q, k_cache, v_cache, tables, seq_lens = _inputs(lens, "bfloat16", group, seed, head_dim)
    starts = torch.tensor([0, *torch.tensor([nq for nq, _ in parts]).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), group * 2, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return q.bfloat16(), k_cache, v_cache, tables, seq_lens, starts


def _assert_prefill_close(got: torch.Tensor, q, k_cache, v_cache, tables, seq_lens, starts) -> None:
    """float32 math on the bf16 values, but the kernel rounds each probability to bf16 before the product with V
    (2^-8 relative: at most 2^-8 max|v| on an output, the probabilities summing to 1) and the output once."""
    want = reference.prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, starts,
                                       scale=0.125)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    bound = 2**-8 * float(v_cache.float().abs().max()) + 2**-8 * want.abs() + 1e-5
    excess = (got.float() - want).abs() - bound
    assert float(excess.max()) <= 0, f"off by {float(excess.max())} past the bound"


@pytest.mark.parametrize("name", [*sorted(PREFILL_BATCHES), "long"])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_bf16_prefill_equals_the_float32_math(ext, name: str, group: int) -> None:
    parts = PREFILL_LONG if name == "long" else PREFILL_BATCHES[name]
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_inputs(parts, group, seed=len(name))
    got = cpu_attention.prefill_attention(ext, q, k_cache, v_cache, tables, seq_lens, starts, scale=0.125)
    _assert_prefill_close(got, q, k_cache, v_cache, tables, seq_lens, starts)


def test_bf16_prefill_rows_do_not_depend_on_the_chunking(ext) -> None:
    """Each query row walks its keys from key 0 in the same chunks whatever rows share its call: a 700-token
    prompt prefilled whole gives the same bits as in chunks of 300, 17 and 383 over its cached prefix, with
    another sequence beside each chunk."""
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_inputs([(700, 700), (40, 90)], 3, seed=21)
    whole = cpu_attention.prefill_attention(ext, q, k_cache, v_cache, tables, seq_lens, starts, scale=0.125)
    pieces, done = [], 0
    for size in (300, 17, 383):
        rows = torch.cat([q[done:done + size], q[700:]])
        lens = torch.tensor([done + size, 90], dtype=seq_lens.dtype)
        sub_starts = torch.tensor([0, size, size + 40], dtype=starts.dtype)
        pieces.append(cpu_attention.prefill_attention(ext, rows, k_cache, v_cache, tables, lens, sub_starts,
                                                      scale=0.125)[:size])
        done += size
    assert torch.equal(torch.cat(pieces), whole[:700])


@pytest.mark.parametrize("head_dim", [128, 16, 576])  # Llama's, the smallest taken, absorbed MLA's (512 + 64)
def test_bf16_prefill_at_other_head_dims(ext, head_dim: int) -> None:
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_inputs(PREFILL_BATCHES["ragged"], 3, seed=head_dim,
                                                                    head_dim=head_dim)
    got = cpu_attention.prefill_attention(ext, q, k_cache, v_cache, tables, seq_lens, starts, scale=0.125)
    _assert_prefill_close(got, q, k_cache, v_cache, tables, seq_lens, starts)


@pytest.mark.parametrize(("change", "message"), [
    ("long", "sequence 1: length 1000 does not fit its block table"),
    ("bad_block", "sequence 0: block id out of range"),
    ("queries", "sequence 0: 20 queries for length 19"),
    ("starts", "query_start_loc must run from 0 to q's rows"),
    ("dtype", "q must be a contiguous bf16"),
    ("head_dim", "D is not a multiple of 16"),
])
def test_bad_prefill_input_is_refused_with_a_named_reason(ext, change: str, message: str) -> None:
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_inputs([(20, 20), (5, 40)], 1, seed=3)
    if change == "long":
        seq_lens[1] = 1000
    elif change == "bad_block":
        tables[0, 0] = 10_000
    elif change == "queries":
        seq_lens[0] = 19
    elif change == "starts":
        starts[-1] = 24
    elif change == "dtype":
        q = q.float()
    else:
        q, k_cache, v_cache, tables, seq_lens, starts = _prefill_inputs([(20, 20), (5, 40)], 1, seed=3, head_dim=40)
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.prefill_attention(ext, q, k_cache, v_cache, tables, seq_lens, starts, scale=0.125)


def test_the_torch_backend_prefills_bf16_through_the_kernel_only(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 without window, sinks or token weights goes to the kernel; float32 and windows keep SDPA."""
    from kvrelay.kernels import torch_attention
    from kvrelay.model.attention import TorchBackend

    sdpa_calls: list[torch.dtype] = []
    real = torch_attention.prefill_attention
    monkeypatch.setattr(torch_attention, "prefill_attention",
                        lambda q, *a, **k: sdpa_calls.append(q.dtype) or real(q, *a, **k))
    backend = TorchBackend()
    args = _prefill_inputs(PREFILL_BATCHES["ragged"], 3, seed=11)
    _assert_prefill_close(backend.prefill_attention(*args, scale=0.125), *args)
    assert sdpa_calls == []
    backend.prefill_attention(*args, scale=0.125, window=8)
    q, k_cache, v_cache, *rest = args
    backend.prefill_attention(q.float(), k_cache.float(), v_cache.float(), *rest, scale=0.125)
    assert sdpa_calls == [torch.bfloat16, torch.float32]


# ------------------------------------------------------------------ deterministic mode's attention (issue 63)
INVARIANT_LENS = (700, 1, 33, 129, 16, 300)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_part_gives_a_sequence_the_same_bits_in_any_batch(ext, dtype: str, threads: int) -> None:
    """``parts=1``: each sequence alone (where the thread-count rule would split its keys) has the bits it has in the
    batch of six, at one thread and at two."""
    q, k_cache, v_cache, tables, seq_lens = _inputs(INVARIANT_LENS, dtype, 3, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = cpu_attention.paged_decode_attention(ext, q, k_cache, v_cache, tables, seq_lens, scale=0.125,
                                                     parts=1)
        for n in range(len(INVARIANT_LENS)):
            alone = cpu_attention.paged_decode_attention(ext, q[n:n + 1], k_cache, v_cache, tables[n:n + 1],
                                                         seq_lens[n:n + 1], scale=0.125, parts=1)
            assert torch.equal(alone[0], batch[n]), f"sequence {n} ({INVARIANT_LENS[n]} keys)"
    finally:
        torch.set_num_threads(before)
    want = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens,
                                            scale=0.125)
    torch.testing.assert_close(batch.float(), want, atol=2e-2 if dtype == "bfloat16" else 1e-5, rtol=0)


def test_a_negative_part_count_is_refused(ext) -> None:
    q, k_cache, v_cache, tables, seq_lens = _inputs((5, 9), "float32", 1, seed=2)
    with pytest.raises(RuntimeError, match="parts must be >= 1, or 0 for the thread-count rule; got -1"):
        cpu_attention.paged_decode_attention(ext, q, k_cache, v_cache, tables, seq_lens, scale=0.125, parts=-1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("window_sinks", [False, True])
def test_prefill_rows_are_the_decode_steps_bits(ext, dtype: str, window_sinks: bool) -> None:
    """`prefill_attention_rows`: a 300-token chunk over a 400-token cached prefix beside a 40-token cold prompt gives
    each query row the bits one decode step at its position gives (that sequence alone, one part), and the
    reference's values; with a window and sinks too."""
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_inputs([(300, 700), (40, 40)], 3, seed=8)
    q, k_cache, v_cache = q.to(getattr(torch, dtype)), k_cache.to(getattr(torch, dtype)), v_cache.to(
        getattr(torch, dtype))
    extra = {"window": 50, "sinks": torch.linspace(-1.0, 1.0, q.shape[1])} if window_sinks else {}
    got = cpu_attention.prefill_attention_rows(ext, q, k_cache, v_cache, tables, seq_lens, starts, scale=0.125,
                                               **extra)
    for row, (seq, pos) in enumerate([(0, 400 + i) for i in range(300)] + [(1, i) for i in range(40)]):
        if row % 37 and row not in (299, 300, 339):  # every 37th row and the ends: each is a full decode call
            continue
        step = cpu_attention.paged_decode_attention(ext, q[row:row + 1], k_cache, v_cache, tables[seq:seq + 1],
                                                    torch.tensor([pos + 1]), scale=0.125, parts=1, **extra)
        assert torch.equal(step[0], got[row]), f"row {row}"
    want = reference.prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, starts,
                                       scale=0.125, **extra)
    torch.testing.assert_close(got.float(), want, atol=2e-2 if dtype == "bfloat16" else 1e-5, rtol=0)


def test_prefill_rows_refuse_more_queries_than_keys(ext) -> None:
    q, k_cache, v_cache, tables, seq_lens, starts = _prefill_inputs([(20, 20), (5, 40)], 1, seed=3)
    seq_lens[0] = 19
    with pytest.raises(ValueError, match="a sequence has more queries than its length"):
        cpu_attention.prefill_attention_rows(ext, q, k_cache, v_cache, tables, seq_lens, starts, scale=0.125)
