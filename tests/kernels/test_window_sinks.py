"""Sliding window and attention sinks (gpt-oss) in every attention backend.

`kernels.reference` is checked against Hugging Face's own gpt-oss attention (``eager_attention_forward``)
with HF's mask functions, over dense K/V read row by row from the cache; every other backend (torch ops,
the C++ CPU decode kernel, Triton decode and unified under ``TRITON_INTERPRET=1`` or on CUDA) against the
reference. Batches mix lengths around block edges (block size 16), prefill chunks start mid-sequence over
cached prefixes, GQA is Hq=4 over Hkv=2, and windows are 1, 5, 16, 17, wider than any sequence, or None.
A windowed sequence must not read the blocks wholly before its window: they are filled with NaN, or their
block-table entries point far past the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from kvrelay.kernels import cpu_attention, reference, torch_attention
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.model.attention import AttentionBatch, ReferenceBackend, TorchBackend, TritonBackend, paged_attention

from tests.kernels.test_triton_attention import LAYER, NUM_LAYERS, PAD_BLOCK_ID

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 16
SCALE = HEAD_DIM**-0.5
WINDOWS = [None, 1, 5, 16, 17, 1000]
# A sink that dominates short rows, one that barely counts, two in between (natural units, unscaled).
SINK_VALUES = (1.5, -0.75, 4.0, -30.0)
DECODE_LENS = (1, 15, 16, 17, 40)
# (cached prefix, new tokens): fresh prompts, chunks starting mid-block over a prefix, decode tokens,
# a sequence with no queries.
PREFILL_SEQS = ((0, 17), (5, 11), (16, 1), (23, 17), (39, 1), (10, 0), (0, 1))
FP32_TOLERANCE = 1e-5
HALF_TOLERANCE = 2e-2
NOT_SUPPORTED = "token weights with a sliding window or attention sinks are not supported"


@dataclass(frozen=True)
class Inputs:
    """One batch: ``seqs`` (prefix, new) per sequence; the caches are layer `LAYER` of ``pool``."""

    seqs: tuple[tuple[int, int], ...]
    pool: torch.Tensor
    q: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    @property
    def k_cache(self) -> torch.Tensor:
        return self.pool[:, LAYER, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool[:, LAYER, 1]

    def decode_args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens

    def prefill_args(self) -> tuple[torch.Tensor, ...]:
        return (*self.decode_args(), self.query_start_loc)

    def replace(self, **changes: torch.Tensor) -> Inputs:
        return Inputs(**{**self.__dict__, **changes})


def make_inputs(seqs: tuple[tuple[int, int], ...], device: torch.device, *, dtype: str = "float32", seed: int = 0,
                table_blocks: int | None = None) -> Inputs:
    """Random KV and queries; shuffled block ids, entries past each sequence's blocks `PAD_BLOCK_ID`."""
    spec = BlockSpec(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size_tokens=BLOCK,
                     dtype=dtype)
    lens = [ctx + new for ctx, new in seqs]
    blocks_per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(spec.pool_shape(num_blocks), generator=gen).to(spec.torch_dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    width = table_blocks if table_blocks is not None else max(blocks_per_seq) + 1
    table = torch.full((len(seqs), width), PAD_BLOCK_ID, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = ids[used : used + n]
        used += n
    counts = [new for _, new in seqs]
    q = torch.randn(sum(counts), NUM_Q_HEADS, HEAD_DIM, generator=gen).to(spec.torch_dtype)
    return Inputs(seqs=seqs, pool=pool.to(device), q=q.to(device), block_tables=table.to(device),
                  seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                  query_start_loc=torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32,
                                               device=device))


def decode_inputs(lens: tuple[int, ...], device: torch.device, **kwargs) -> Inputs:
    return make_inputs(tuple((n - 1, 1) for n in lens), device, **kwargs)


def sinks_for(on: bool, device: torch.device) -> torch.Tensor | None:
    return torch.tensor(SINK_VALUES, dtype=torch.float32, device=device) if on else None


def first_visible(ctx: int, window: int | None) -> int:
    """The first key position a chunk whose first query sits at ``ctx`` can see."""
    return 0 if window is None else max(0, ctx - window + 1)


def blocks_before_window(inputs: Inputs, window: int | None) -> list[tuple[int, int]]:
    """(sequence, table index) of every block no query of its sequence may read: wholly before the first
    query's window, or any block of a sequence without queries."""
    out = []
    for i, (ctx, new) in enumerate(inputs.seqs):
        num_blocks = -(-(ctx + new) // BLOCK)
        end = num_blocks if new == 0 else first_visible(ctx, window) // BLOCK
        out += [(i, b) for b in range(end)]
    return out


def poisoned_kv(inputs: Inputs, window: int | None) -> Inputs:
    """A copy with every block `blocks_before_window` filled with NaN (K and V)."""
    pool = inputs.pool.clone()
    cells = blocks_before_window(inputs, window)
    assert cells, "the case must have blocks outside the window"
    for i, b in cells:
        pool[int(inputs.block_tables[i, b]), LAYER] = float("nan")
    return inputs.replace(pool=pool)


def freed_table_entries(inputs: Inputs, window: int | None) -> Inputs:
    """A copy whose `blocks_before_window` table entries point far past the pool (freed blocks)."""
    tables = inputs.block_tables.clone()
    cells = blocks_before_window(inputs, window)
    assert cells, "the case must have blocks outside the window"
    for i, b in cells:
        tables[i, b] = PAD_BLOCK_ID
    return inputs.replace(block_tables=tables)


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def hf_attention(inputs: Inputs, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Hugging Face's gpt-oss eager attention with HF's (sliding-window) causal mask, in float64, one
    sequence at a time over K/V read row by row from the cache. ``[T, Hq, D]`` float64."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    sink_logits = (torch.full((NUM_Q_HEADS,), float("-inf")) if sinks is None else sinks.cpu()).double()
    module = SimpleNamespace(sinks=sink_logits, num_key_value_groups=NUM_Q_HEADS // NUM_KV_HEADS, training=False)
    k_cache, v_cache, table = inputs.k_cache.cpu().double(), inputs.v_cache.cpu().double(), inputs.block_tables.cpu()
    out = torch.zeros(inputs.q.shape, dtype=torch.float64)
    start = 0
    for i, (ctx, new) in enumerate(inputs.seqs):
        if new == 0:
            continue
        length = ctx + new
        k = torch.stack([k_cache[int(table[i, p // BLOCK]), :, p % BLOCK] for p in range(length)])  # [S, Hkv, D]
        v = torch.stack([v_cache[int(table[i, p // BLOCK]), :, p % BLOCK] for p in range(length)])
        allowed = mask_function(0, 0, torch.arange(ctx, length)[:, None], torch.arange(length)[None, :])
        mask = torch.zeros(new, length, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        query = inputs.q[start : start + new].cpu().double().transpose(0, 1)[None]  # [1, Hq, Tq, D]
        o, _ = eager_attention_forward(module, query, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       mask[None, None], SCALE)
        out[start : start + new] = o[0]
        start += new
    return out


# --- the reference against Hugging Face --------------------------------------------------------------

@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
def test_reference_prefill_matches_hf_gpt_oss(window, sinks_on):
    inputs = make_inputs(PREFILL_SEQS, torch.device("cpu"), seed=1)
    sinks = sinks_for(sinks_on, torch.device("cpu"))
    got = reference.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got.double(), hf_attention(inputs, window, sinks)) <= FP32_TOLERANCE


@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
def test_reference_decode_matches_hf_gpt_oss(window, sinks_on):
    inputs = decode_inputs(DECODE_LENS, torch.device("cpu"), seed=2)
    sinks = sinks_for(sinks_on, torch.device("cpu"))
    got = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got.double(), hf_attention(inputs, window, sinks)) <= FP32_TOLERANCE


def test_window_and_sinks_change_the_result():
    """Guards the comparisons above against a no-op: each feature moves the output."""
    inputs = decode_inputs(DECODE_LENS, torch.device("cpu"), seed=2)
    plain = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE)
    windowed = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=5)
    sunk = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, sinks=sinks_for(True, plain.device))
    assert max_err(plain, windowed) > 0.05 and max_err(plain, sunk) > 0.05
    # a window of 1 sees only the newest token: the output is its value row
    one = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=1)
    newest = [inputs.v_cache[int(inputs.block_tables[i, (n - 1) // BLOCK]), :, (n - 1) % BLOCK]
              for i, n in enumerate(DECODE_LENS)]
    assert torch.equal(one, torch.stack(newest).repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1))


# --- torch ops and the C++ kernel (CPU) -----------------------------------------------------------

@pytest.fixture(scope="module")
def ext():
    built = cpu_attention.load()
    assert built is not None, "the C++ CPU decode attention did not build here (g++ and ninja are installed)"
    return built


def _decode(backend: str, ext, inputs: Inputs, **kwargs) -> torch.Tensor:
    if backend == "torch":
        return torch_attention.paged_decode_attention(*inputs.decode_args(), scale=SCALE, **kwargs)
    if backend == "cpp":
        return cpu_attention.paged_decode_attention(ext, *inputs.decode_args(), scale=SCALE, **kwargs)
    from kvrelay.kernels import triton_attention, triton_unified

    if backend == "triton":
        return triton_attention.paged_decode_attention(*inputs.decode_args(), scale=SCALE, **kwargs)
    return triton_unified.unified_attention(*inputs.prefill_args(), scale=SCALE, **kwargs)


def _prefill(backend: str, inputs: Inputs, **kwargs) -> torch.Tensor:
    if backend == "torch":
        return torch_attention.prefill_attention(*inputs.prefill_args(), scale=SCALE, **kwargs)
    from kvrelay.kernels import triton_unified

    return triton_unified.unified_attention(*inputs.prefill_args(), scale=SCALE, **kwargs)


@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_cpu_decode_matches_reference(backend, window, sinks_on, ext):
    inputs = decode_inputs(DECODE_LENS, torch.device("cpu"), seed=3)
    sinks = sinks_for(sinks_on, torch.device("cpu"))
    got = _decode(backend, ext, inputs, window=window, sinks=sinks)
    want = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_prefill_matches_reference(window, sinks_on):
    inputs = make_inputs(PREFILL_SEQS, torch.device("cpu"), seed=4)
    sinks = sinks_for(sinks_on, torch.device("cpu"))
    got = torch_attention.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    want = reference.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


def test_torch_prefill_groups_by_length_with_window_and_sinks():
    """Chunks of very different lengths go in separate SDPA calls (`torch_attention._padding_groups`)."""
    inputs = make_inputs(((0, 70), (40, 3), (3, 2), (60, 1), (0, 0)), torch.device("cpu"), seed=5)
    assert len(torch_attention._padding_groups([70, 3, 2, 1, 0])) > 1
    sinks = sinks_for(True, torch.device("cpu"))
    got = torch_attention.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=17, sinks=sinks)
    want = reference.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=17, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


@pytest.mark.parametrize("window", [None, 5, 17])
def test_cpu_bf16_is_close_to_the_reference(window, ext):
    cpu = torch.device("cpu")
    sinks = sinks_for(True, cpu)
    decode = decode_inputs(DECODE_LENS, cpu, dtype="bfloat16", seed=6)
    want = reference.paged_decode_attention(*decode.decode_args(), scale=SCALE, window=window, sinks=sinks)
    for backend in ("torch", "cpp"):
        got = _decode(backend, ext, decode, window=window, sinks=sinks)
        assert got.dtype == torch.bfloat16 and max_err(got, want) <= HALF_TOLERANCE
    prefill = make_inputs(PREFILL_SEQS, cpu, dtype="bfloat16", seed=6)
    got = torch_attention.prefill_attention(*prefill.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    want = reference.prefill_attention(*prefill.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    assert got.dtype == torch.bfloat16 and max_err(got, want) <= HALF_TOLERANCE


def test_torch_backend_plans_once_per_step_and_window(monkeypatch: pytest.MonkeyPatch):
    """gpt-oss alternates sliding and full layers: one decode plan per window per step, not per layer."""
    plans: list[int | None] = []
    real = torch_attention.decode_plan
    monkeypatch.setattr(torch_attention, "decode_plan",
                        lambda *args: plans.append(args[-1]) or real(*args))
    backend = TorchBackend()
    backend.cpu_decode_kernels = None  # the torch-op path
    inputs = decode_inputs(DECODE_LENS, torch.device("cpu"), seed=7)
    sinks = sinks_for(True, torch.device("cpu"))
    for layer in range(4):
        window = 5 if layer % 2 == 0 else None
        got = backend.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=window, sinks=sinks)
        want = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=window, sinks=sinks)
        assert max_err(got, want) <= FP32_TOLERANCE
    assert plans == [5, None]


def test_torch_backend_decodes_windows_through_the_kernel(ext, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch_attention, "paged_decode_attention", lambda *a, **k: pytest.fail("the torch-op path ran"))
    inputs = decode_inputs(DECODE_LENS, torch.device("cpu"), seed=8)
    sinks = sinks_for(True, torch.device("cpu"))
    got = TorchBackend().paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=5, sinks=sinks)
    want = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=5, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


# --- Triton (interpreted on CPU, compiled on CUDA) ----------------------------------------------------

@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_decode_matches_reference(window, sinks_on, kernel_device):
    inputs = decode_inputs(DECODE_LENS, kernel_device, seed=9, table_blocks=20)  # 320 tokens: 2 splits
    sinks = sinks_for(sinks_on, kernel_device)
    got = _decode("triton", None, inputs, window=window, sinks=sinks)
    want = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


@pytest.mark.parametrize("window", [17, 64, 200, 299])
def test_triton_decode_splits_only_the_window(window, kernel_device):
    """A window wider than a tile over 3 splits: the window's range is what gets split."""
    from kvrelay.kernels import triton_attention

    inputs = decode_inputs((300, 257, 17, 1), kernel_device, seed=10, table_blocks=40)
    assert triton_attention.decode_num_splits(40 * BLOCK) == 3
    sinks = sinks_for(True, kernel_device)
    got = _decode("triton", None, inputs, window=window, sinks=sinks)
    want = reference.paged_decode_attention(*inputs.decode_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


@pytest.mark.parametrize("sinks_on", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_unified_matches_reference(window, sinks_on, kernel_device):
    inputs = make_inputs(PREFILL_SEQS, kernel_device, seed=11)
    sinks = sinks_for(sinks_on, kernel_device)
    got = _prefill("triton", inputs, window=window, sinks=sinks)
    want = reference.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


def test_triton_unified_long_chunk_over_a_prefix(kernel_device):
    """Several query tiles per sequence, each starting its KV loop at its own first query's window."""
    inputs = make_inputs(((100, 90), (0, 130), (250, 1)), kernel_device, seed=12)
    sinks = sinks_for(True, kernel_device)
    for window in (1, 17, 70):
        got = _prefill("triton", inputs, window=window, sinks=sinks)
        want = reference.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=window, sinks=sinks)
        assert max_err(got, want) <= FP32_TOLERANCE


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_half_precision(dtype, kernel_device):
    sinks = sinks_for(True, kernel_device)
    decode = decode_inputs(DECODE_LENS, kernel_device, dtype=dtype, seed=13)
    got = _decode("triton", None, decode, window=5, sinks=sinks)
    want = reference.paged_decode_attention(*decode.decode_args(), scale=SCALE, window=5, sinks=sinks)
    assert max_err(got, want) <= HALF_TOLERANCE
    prefill = make_inputs(PREFILL_SEQS, kernel_device, dtype=dtype, seed=13)
    got = _prefill("triton", prefill, window=17, sinks=sinks)
    want = reference.prefill_attention(*prefill.prefill_args(), scale=SCALE, window=17, sinks=sinks)
    assert max_err(got, want) <= HALF_TOLERANCE


# --- nothing outside the window is read --------------------------------------------------------------

@pytest.mark.parametrize("window", [5, 17])
@pytest.mark.parametrize("backend", ["torch", "cpp", "triton", "unified"])
def test_windowed_decode_reads_no_block_before_the_window(backend, window, ext, kernel_device):
    device = torch.device("cpu") if backend in ("torch", "cpp") else kernel_device
    clean = decode_inputs((40, 33, 17, 1), device, seed=14, table_blocks=20)
    sinks = sinks_for(True, device)
    want = reference.paged_decode_attention(*clean.decode_args(), scale=SCALE, window=window, sinks=sinks)
    for inputs in (poisoned_kv(clean, window), freed_table_entries(clean, window)):
        got = _decode(backend, ext, inputs, window=window, sinks=sinks)
        assert torch.isfinite(got).all()
        assert max_err(got, want) <= FP32_TOLERANCE


@pytest.mark.parametrize("window", [5, 17])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_windowed_prefill_reads_no_block_before_the_window(backend, window, kernel_device):
    device = torch.device("cpu") if backend == "torch" else kernel_device
    clean = make_inputs(((40, 3), (35, 10), (16, 1), (0, 5), (30, 0)), device, seed=15)
    sinks = sinks_for(True, device)
    want = reference.prefill_attention(*clean.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    for inputs in (poisoned_kv(clean, window), freed_table_entries(clean, window)):
        got = _prefill(backend, inputs, window=window, sinks=sinks)
        assert torch.isfinite(got).all()
        assert max_err(got, want) <= FP32_TOLERANCE


def test_reference_reads_no_freed_table_entry():
    """The reference accepts freed (out-of-range) ids before the window, and gives the same result."""
    sinks = sinks_for(True, torch.device("cpu"))
    decode = decode_inputs((40, 33, 17, 1), torch.device("cpu"), seed=14)
    prefill = make_inputs(((40, 3), (35, 10), (16, 1), (0, 5), (30, 0)), torch.device("cpu"), seed=15)
    for window in (5, 17):
        want = reference.paged_decode_attention(*decode.decode_args(), scale=SCALE, window=window, sinks=sinks)
        got = reference.paged_decode_attention(*freed_table_entries(decode, window).decode_args(), scale=SCALE,
                                               window=window, sinks=sinks)
        assert torch.equal(got, want)
        want = reference.prefill_attention(*prefill.prefill_args(), scale=SCALE, window=window, sinks=sinks)
        got = reference.prefill_attention(*freed_table_entries(prefill, window).prefill_args(), scale=SCALE,
                                          window=window, sinks=sinks)
        assert torch.equal(got, want)


# --- model.attention.paged_attention ----------------------------------------------------------------

@pytest.mark.parametrize(("backend_class", "unified"), [
    (ReferenceBackend, False), (TorchBackend, False), (TritonBackend, False), (TritonBackend, True)],
    ids=["reference", "torch", "triton-split", "triton-unified"])
def test_paged_attention_passes_window_and_sinks_to_every_kernel(backend_class, unified, kernel_device):
    """A step of prefill chunks and decode tokens: each goes through its kernel with the layer's window
    and sinks (with Triton and ``step_*`` tables, one unified launch)."""
    device = kernel_device if backend_class is TritonBackend else torch.device("cpu")
    prefill_seqs, decode_lens = ((0, 17), (23, 17)), (40, 16, 1)
    inputs = make_inputs(prefill_seqs + tuple((n - 1, 1) for n in decode_lens), device, seed=16)
    num_prefill_tokens = 34
    # The step's KV is written by paged_attention: take it out of the cache, then write it back through it.
    slots = []
    for i, (ctx, new) in enumerate(inputs.seqs):
        slots += [int(inputs.block_tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(ctx, ctx + new)]
    slot_mapping = torch.tensor(slots, device=device)
    blocks, rows = slot_mapping // BLOCK, slot_mapping % BLOCK
    k, v = inputs.k_cache[blocks, :, rows].clone(), inputs.v_cache[blocks, :, rows].clone()
    sinks = sinks_for(True, device)
    want = reference.prefill_attention(*inputs.prefill_args(), scale=SCALE, window=5, sinks=sinks)
    layer_cache = inputs.pool[:, LAYER].clone()
    layer_cache[blocks, :, :, rows] = 0.0
    n = len(prefill_seqs)
    batch = AttentionBatch(
        slot_mapping=slot_mapping, num_prefill_tokens=num_prefill_tokens,
        prefill_block_tables=inputs.block_tables[:n], prefill_seq_lens=inputs.seq_lens[:n],
        prefill_query_start_loc=inputs.query_start_loc[: n + 1],
        decode_block_tables=inputs.block_tables[n:], decode_seq_lens=inputs.seq_lens[n:],
        step_block_tables=inputs.block_tables if unified else None, step_seq_lens=inputs.seq_lens if unified else None,
        step_query_start_loc=inputs.query_start_loc if unified else None,
    )
    got = paged_attention(backend_class(), inputs.q, k, v, layer_cache, batch, scale=SCALE, window=5, sinks=sinks)
    assert max_err(got, want) <= FP32_TOLERANCE


# --- refusals -------------------------------------------------------------------------------------

def _kernels(device: torch.device, ext) -> dict:
    """name -> (function taking the decode-shaped `Inputs` and keyword arguments)."""
    from kvrelay.kernels import triton_attention, triton_unified

    cpu_only = {
        "reference-decode": lambda i, **kw: reference.paged_decode_attention(*i.decode_args(), scale=SCALE, **kw),
        "reference-prefill": lambda i, **kw: reference.prefill_attention(*i.prefill_args(), scale=SCALE, **kw),
        "torch-decode": lambda i, **kw: torch_attention.paged_decode_attention(*i.decode_args(), scale=SCALE, **kw),
        "torch-prefill": lambda i, **kw: torch_attention.prefill_attention(*i.prefill_args(), scale=SCALE, **kw),
        "torch-backend-decode": lambda i, **kw: TorchBackend().paged_decode_attention(*i.decode_args(), scale=SCALE,
                                                                                        **kw),
        "cpp-decode": lambda i, **kw: cpu_attention.paged_decode_attention(ext, *i.decode_args(), scale=SCALE, **kw),
    }
    triton = {
        "triton-decode": lambda i, **kw: triton_attention.paged_decode_attention(*i.decode_args(), scale=SCALE, **kw),
        "triton-unified": lambda i, **kw: triton_unified.unified_attention(*i.prefill_args(), scale=SCALE, **kw),
    }
    return {**cpu_only, **triton}


KERNEL_NAMES = ["reference-decode", "reference-prefill", "torch-decode", "torch-prefill", "torch-backend-decode",
                "cpp-decode", "triton-decode", "triton-unified"]


def _device_for(name: str, kernel_device: torch.device) -> torch.device:
    return kernel_device if name.startswith("triton") else torch.device("cpu")


@pytest.mark.parametrize("name", [name for name in KERNEL_NAMES if name != "cpp-decode"])  # it has no weights
def test_token_weights_with_window_or_sinks_are_refused(name, ext, kernel_device):
    device = _device_for(name, kernel_device)
    inputs = decode_inputs((20, 3), device, seed=17)
    kernel = _kernels(device, ext)[name]
    for extra in (dict(window=5), dict(sinks=sinks_for(True, device)), dict(window=5, sinks=sinks_for(True, device))):
        weights = torch.zeros(2, NUM_KV_HEADS, 32, device=device)
        with pytest.raises(ValueError, match=NOT_SUPPORTED):
            kernel(inputs, token_weights=weights, **extra)


@pytest.mark.parametrize(("extra", "message"), [
    (dict(window=0), r"window is 0; use None \(full causal attention\) or a token count >= 1"),
    (dict(window=-3), r"window is -3"),
    (dict(window=True), r"window is True"),
    (dict(window=5.0), r"window is 5\.0"),
    (dict(sinks="half"), r"sinks\.dtype is torch\.float16; use torch\.float32"),
    (dict(sinks="short"), r"sinks shape \(2,\) does not fit; expected \[4\]"),
])
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_bad_window_or_sinks_are_refused(name, extra, message, ext, kernel_device):
    device = _device_for(name, kernel_device)
    inputs = decode_inputs((20, 3), device, seed=18)
    if "sinks" in extra:
        sinks = sinks_for(True, device)
        extra = dict(sinks=sinks.half() if extra["sinks"] == "half" else sinks[:2])
    with pytest.raises(ValueError, match=message):
        _kernels(device, ext)[name](inputs, **extra)


# --- compiled on CUDA -------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("window", [None, 128, 1000])
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", FP32_TOLERANCE), ("bfloat16", HALF_TOLERANCE)])
def test_gpu_matches_reference(window, dtype, tolerance, no_tf32):
    """gpt-oss's sliding layers (window 128) over long contexts and wide (CUDA-graph) tables."""
    cuda = torch.device("cuda")
    sinks = sinks_for(True, cuda)
    decode = decode_inputs((1, 127, 128, 129, 3000, 4097), cuda, dtype=dtype, seed=19, table_blocks=300)
    got = _decode("triton", None, decode, window=window, sinks=sinks)
    want = reference.paged_decode_attention(*decode.decode_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got, want) <= tolerance
    prefill = make_inputs(((0, 700), (2000, 300), (4000, 1), (130, 129)), cuda, dtype=dtype, seed=19)
    got = _prefill("triton", prefill, window=window, sinks=sinks)
    want = reference.prefill_attention(*prefill.prefill_args(), scale=SCALE, window=window, sinks=sinks)
    assert max_err(got, want) <= tolerance
