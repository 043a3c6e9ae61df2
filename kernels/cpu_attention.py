"""Paged decode attention as one C++ loop per (sequence, KV head): the CPU decode path.

`kernels.torch_attention.paged_decode_attention` needs about fifteen torch ops per layer (gather,
two batched matmuls, masking, float32 softmax, casts, a sum), each a few microseconds of dispatch:
at batch 1 that is most of the attention time. ``csrc/decode_attention.cpp`` does the same math in
one call: for each (sequence, KV head), a pass over the sequence's K blocks in place (no gather)
for the float32 scores of the head's query group, a float32 softmax, a pass over its V blocks;
split over torch's own thread pool (``at::parallel_for``). With fewer (sequence, KV head) pairs than
twice the threads (batch 1), each pair's keys are split into parts merged by log-sum-exp, so that every
thread works (SmolLM2, 150 keys, bf16: 17-19 µs against 24 µs a call on a Zen 4 VM). Measured here
for SmolLM2's shapes (9 query heads, 3 KV heads, 64 dims, 288-token contexts, bf16, 2 threads): 21 µs
against 112 µs at 1 sequence, 262 µs against 421 µs at 16. In bf16 at head dims 64 and 128 with AVX512-BF16,
the score pass is VDPBF16PS over sixteen keys at a time and the value pass keeps the query heads' sums in
registers: a further 0.37x the time at 600 keys (16.2 against 44.2 µs at batch 1, 233 against 628 at 16).

It is compiled on first use with torch's extension builder (g++, about 20 s, once per machine, with
``csrc/small_ops.cpp`` beside it as one extension, `kernels.cpu_build.CPU_KERNELS`:
cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). ``-ffast-math`` lets the
compiler vectorize ``exp`` (glibc's vector math); scores are finite by construction (the softmax
subtracts the row maximum), so only the summation order differs from the reference (observed
≤ 4e-7 absolute in float32). Where the build fails (no compiler) or ``KVRELAY_CPU_KERNELS=0``,
`load` returns None and callers use the torch path.
"""

from __future__ import annotations

from types import ModuleType

import torch
from kvrelay.kernels import reference
from kvrelay.kernels.cpu_build import CPU_KERNELS


def load() -> ModuleType | None:
    """The compiled extension (`kernels.cpu_build.CPU_KERNELS`, built on first call), or None when disabled or the
    build failed."""
    return CPU_KERNELS.load()


def paged_decode_attention(ext: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           window: int | None = None, sinks: torch.Tensor | None = None,
                           parts: int = 0) -> torch.Tensor:
    """`kernels.reference.paged_decode_attention` (no token weights) through ``ext``.

    q ``[N, Hq, D]`` and the caches ``[num_blocks, Hkv, B, D]`` (each block's ``[Hkv, B, D]``
    contiguous, as slices of the KV pool are) share one dtype, float32 or bfloat16; tables
    ``[N, ≥ ceil(len/B)]``; every length ≥ 1. ``window`` (tokens, >= 1) and ``sinks`` (float32 ``[Hq]``
    on the CPU) as in the reference: a windowed sequence's loops start at position ``len - window``, so
    blocks before it are never read; a sink is one more logit in each head's max and sum. ``parts``: how many
    runs each (sequence, KV head)'s keys are split into (module doc), or 0 for the rule that splits them when the
    batch is small; the order of the sums follows the parts, so only a fixed count (1) gives a sequence the same
    bits in any batch and at any thread count (`prefill_attention_rows`, deterministic mode).
    Returns ``[N, Hq, D]`` in q's dtype.

    Raises:
        ValueError: ``window`` or ``sinks`` do not fit (`kernels.reference.check_window_and_sinks`).
        RuntimeError: naming the broken condition (a length past its table, a block id out of
            range, mismatched shapes or dtypes).
    """
    reference.check_window_and_sinks(window, sinks, num_q_heads=q.shape[1], device=q.device, token_weights=None)
    return ext.paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, float(scale),
                                      0 if window is None else window, sinks, parts)


def prefill_attention_rows(ext: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                           scale: float, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention as decode attention: each query row is its own one-query sequence over the keys up to
    its position, through `paged_decode_attention` with one part. A token's output then has the bits a decode
    step gives it, whatever its chunk, its batch or the thread count: deterministic mode's prefill
    (`model.attention.TorchBackend`), where a prompt's KV recomputed (a migration, a lost pull) must equal the KV
    a decode node wrote token by token. Its cost against the flash kernel: `kvrelay bench deterministic`.

    Inputs as `prefill_attention` (KV of q's dtype, float32 or bf16, any head dim), with ``window`` and ``sinks``
    as in `paged_decode_attention`. Returns ``[T, Hq, D]`` in q's dtype.

    Raises:
        ValueError: a sequence with more queries than its length, or ``window``/``sinks`` that do not fit.
        RuntimeError: as `paged_decode_attention`.
    """
    starts = query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    lens = seq_lens.to(torch.int64)
    if bool((q_lens > lens).any()):
        raise ValueError("prefill_attention_rows: a sequence has more queries than its length")
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    # row r of sequence n is query r - starts[n] of n's q_len, at position lens[n] - q_len + that
    row_lens = (lens - q_lens)[seq_of_row] + (torch.arange(q.shape[0]) - starts[:-1][seq_of_row]) + 1
    tables = block_tables.index_select(0, seq_of_row)
    return paged_decode_attention(ext, q, k_cache, v_cache, tables, row_lens, scale=scale, window=window,
                                  sinks=sinks, parts=1)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` takes these inputs (else use the torch path)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype == q.dtype
            and q.shape[0] > 0)


def prefill_attention(ext: ModuleType, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                      scale: float) -> torch.Tensor:
    """`kernels.reference.prefill_attention` (no token weights, window or sinks) through ``ext``'s flash-style
    bf16 kernel (``csrc/prefill_attention.cpp``).

    q ``[T, Hq, D]`` and the caches ``[num_blocks, Hkv, B, D]`` (each block's ``[Hkv, B, D]`` contiguous) bf16,
    D a multiple of 16; tables ``[N, ≥ ceil(len/B)]``; sequence n's queries are rows ``query_start_loc[n] ..
    query_start_loc[n+1]-1``, the last ``q_len`` positions of its ``seq_lens[n]``. Returns bf16 ``[T, Hq, D]``:
    float32 scores, softmax and sums, the probabilities rounded to bf16 before the product with V (as torch's
    flash attention in bf16).

    Raises:
        RuntimeError: naming the broken condition (a length past its table, a block id out of range, more
            queries than a sequence's length, mismatched shapes or dtypes).
    """
    return ext.prefill_attention_bf16(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                      float(scale))


def supports_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes these inputs (else use the torch path)."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[0] > 0 and q.shape[-1] % 16 == 0
            and all(c.dtype == torch.bfloat16 and c.dim() == 4 and c.shape[1:] == k_cache.shape[1:]
                    and c.stride(0) == k_cache.stride(0) and c.stride(3) == 1 and c.stride(2) == c.shape[3]
                    and c.stride(1) == c.shape[2] * c.shape[3] for c in (k_cache, v_cache)))
