"""Per-step attention metadata and the attention backends the model calls.

A step's tokens are laid out prefill-first::

    tokens: [ prefill seq 0 | prefill seq 1 | ... | decode 0 | decode 1 | ... ]
             0                    num_prefill_tokens                       T

Prefill sequences may start after a cached prefix (chunked prefill / prefix reuse); every decode
sequence contributes exactly one token. Decode tokens go through the paged decode kernel, prefill
tokens through prefill attention, so a sequence's decode math is the same whatever else is batched —
except with a backend that has ``unified_attention`` (Triton): a step holding both prefill and decode
tokens is one launch over the ``step_*`` tables (decode sequences as one-query sequences); a decode-only
step keeps the split-K decode kernel, which splits long contexts over more programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from kvrelay.kernels import cpu_attention, reference, torch_attention
from kvrelay.model.kernel_plan import KernelPlan


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """Where each token of one model step reads and writes KV.

    Attributes:
        slot_mapping: ``[T]`` int64, the slot each token's KV is written to.
        num_prefill_tokens: tokens ``[0, num_prefill_tokens)`` belong to prefill sequences.
        prefill_block_tables: ``[Np, M]`` int32 block tables of the prefill sequences.
        prefill_seq_lens: ``[Np]`` int32 total length of each prefill sequence after this step.
        prefill_query_start_loc: ``[Np + 1]`` int32 cumulative new-token counts, starting at 0.
        decode_block_tables: ``[Nd, M']`` int32 block tables of the decode sequences.
        decode_seq_lens: ``[Nd]`` int32 tokens each decode sequence attends over, its new token included
            (its KV length: a long-context policy may hold fewer tokens than the sequence's position).
        kv_hook: a long-context policy's per-layer calls (`KvHook`), or None.
        step_block_tables, step_seq_lens, step_query_start_loc: every sequence of the step, prefill ones
            then decode ones (one query each), for a backend's ``unified_attention``; None when the
            step has no prefill or no decode token, or the backend has no such kernel.
        group_batches: with several KV block groups, one batch per group (group 0 is this one's
            content); None with one group. See `for_group`.
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    kv_hook: KvHook | None = None
    step_block_tables: torch.Tensor | None = None
    step_seq_lens: torch.Tensor | None = None
    step_query_start_loc: torch.Tensor | None = None
    group_batches: tuple[AttentionBatch, ...] | None = None

    def for_group(self, group: int) -> AttentionBatch:
        """The batch of KV block group ``group`` (`kvstore.block_spec`: its own tables and slots; the same
        sequences, lengths and tokens): ``group_batches[group]``, or this batch when there is one group."""
        return self if self.group_batches is None else self.group_batches[group]

    @property
    def num_decode_tokens(self) -> int:
        return int(self.decode_seq_lens.shape[0])


class KvHook(Protocol):
    """What a long-context policy does inside one model step, layer by layer (see `engine.kv_policy`).

    Each decoder layer first calls ``layer_input(layer, x_decode, cos_sin_decode)`` with its input (the
    residual stream) of the step's decode tokens and their rotary tables (InfiniGen's speculation of the
    next layer). `paged_attention` then calls, for each layer: ``before_decode(layer, q_decode, layer_cache)`` after the
    step's KV is written and before decode attention (block selection and recall), then attention
    with ``token_weights(layer)`` as the output buffers for per-token attention weights, then
    ``after_attention(layer)`` (score accumulation).
    """

    def layer_input(self, layer: int, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None: ...

    def before_decode(self, layer: int, q: torch.Tensor, layer_cache: torch.Tensor) -> None: ...

    def token_weights(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(prefill_weights [Np, Hkv, W] | None, decode_weights [Nd, Hkv, W] | None)`` float32."""
        ...

    def after_attention(self, layer: int) -> None: ...


class AttentionBackend(Protocol):
    """The three kernels a model step needs; signatures and contracts as in `kernels.reference`.

    ``window`` (sliding window in tokens, or None) and ``sinks`` (float32 ``[Hq]`` per-head sink logits, or
    None) follow Hugging Face transformers (gpt-oss); see `kernels.reference`. Every backend raises
    ValueError for ``token_weights`` together with either.
    """

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                               scale: float, token_weights: torch.Tensor | None = None,
                               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, *, scale: float,
                          token_weights: torch.Tensor | None = None, window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def block_key_summaries(self, kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor: ...

    def score_blocks(self, q: torch.Tensor, summaries: torch.Tensor, cand_rows: torch.Tensor, *,
                     scale: float) -> torch.Tensor: ...


class ReferenceBackend:
    """Plain torch, one sequence at a time in prefill; the oracle."""

    write_kv = staticmethod(reference.write_kv)
    paged_decode_attention = staticmethod(reference.paged_decode_attention)
    prefill_attention = staticmethod(reference.prefill_attention)
    block_key_summaries = staticmethod(reference.block_key_summaries)
    score_blocks = staticmethod(reference.score_blocks)


MAX_STEP_GROUPS = 4  # slot plans TorchBackend keeps: one per KV block group of the step


class TorchBackend:
    """Batched plain-torch attention (`kernels.torch_attention`: fused SDPA in prefill, block-wise matmuls in
    decode); the CPU path.

    A step calls each kernel once per layer with the same metadata tensors, so the metadata's derived
    index tensors (`torch_attention.slot_plan`, `decode_plan`, one per window) are computed once per step,
    for the first layer, and reused while the same tensor objects come back (the model runner builds fresh
    ones every step and nobody writes into them). One instance per engine, used from one thread.

    Decode attention goes through the C++ kernel of `kernels.cpu_attention` where it builds and takes
    the inputs (CPU, float32/bf16 KV in the query's dtype, no token weights; window and sinks included),
    else through torch ops. Prefill attention goes through its flash-style bf16 kernel there (bf16 q and KV,
    head dim a multiple of 16, no token weights, window or sinks: SmolLM2 at 2,048 tokens, ~0.5x SDPA's time
    on a Zen 4 VM), else through SDPA. Either C++ kernel is used only where the engine's kernel plan
    (`model.kernel_plan`, timed on the machine) found it the faster (`follow`).

    Under a deterministic plan (``invariant``) both go through the C++ decode kernel with each sequence's keys in one
    part, prefill as one decode row per token (`kernels.cpu_attention.prefill_attention_rows`): a token's output
    has the same bits whatever else the step holds, however its prompt was chunked, at any thread count.
    """

    block_key_summaries = staticmethod(reference.block_key_summaries)
    score_blocks = staticmethod(reference.score_blocks)

    def __init__(self) -> None:
        self.cpu_decode_kernels = cpu_attention.load()  # the C++ attention kernels' extension, or None
        # whether the per-layer path takes the C++ prefill / decode attention where it fits (`follow`)
        self.cpp_prefill = self.cpp_decode = True
        self.invariant = False  # a deterministic plan's attention (class doc; `follow`)
        # (slot_mapping, block_size, plan) of the current step, one per KV block group (`AttentionBatch.for_group`)
        self._slots: list[tuple[torch.Tensor, int, torch_attention.SlotPlan]] = []
        # (block_tables, seq_lens, block_size, window -> plan) of the current step
        self._decode: tuple[torch.Tensor, torch.Tensor, int, dict[int | None, torch_attention.DecodePlan]] | None = None

    def follow(self, plan: KernelPlan) -> None:
        """Take ``plan``'s prefill and decode attention paths (``cpp`` or ``torch``; the invariant ones for a
        deterministic plan).

        Raises:
            ValueError: a deterministic plan without the C++ kernels.
        """
        if plan.deterministic and self.cpu_decode_kernels is None:
            raise ValueError("a deterministic plan needs the C++ attention kernels, which did not build here")
        self.cpp_prefill, self.cpp_decode = plan.prefill_attention == "cpp", plan.decode_attention == "cpp"
        self.invariant = plan.deterministic

    def _refuse_variant(self, token_weights: torch.Tensor | None) -> None:
        if token_weights is not None:
            raise ValueError("deterministic attention does not give token weights (a long-context policy's)")

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        block_size = k_cache.shape[2]
        memo = next((m for m in self._slots if m[0] is slot_mapping and m[1] == block_size), None)
        if memo is None:
            memo = (slot_mapping, block_size, torch_attention.slot_plan(slot_mapping, block_size))
            self._slots = [*self._slots[-(MAX_STEP_GROUPS - 1):], memo]
        torch_attention.write_kv(k_cache, v_cache, key, value, slot_mapping, plan=memo[2])

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                          scale: float, token_weights: torch.Tensor | None = None, window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.invariant:
            self._refuse_variant(token_weights)
            return cpu_attention.prefill_attention_rows(self.cpu_decode_kernels, q, k_cache, v_cache, block_tables,
                                                        seq_lens, query_start_loc, scale=scale, window=window,
                                                        sinks=sinks)
        if (self.cpu_decode_kernels is not None and self.cpp_prefill and token_weights is None and window is None
                and sinks is None and cpu_attention.supports_prefill(q, k_cache, v_cache)):
            return cpu_attention.prefill_attention(self.cpu_decode_kernels, q, k_cache, v_cache, block_tables,
                                                   seq_lens, query_start_loc, scale=scale)
        return torch_attention.prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                 scale=scale, token_weights=token_weights, window=window, sinks=sinks)

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                               token_weights: torch.Tensor | None = None, window: int | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.invariant:
            self._refuse_variant(token_weights)
            return cpu_attention.paged_decode_attention(self.cpu_decode_kernels, q, k_cache, v_cache, block_tables,
                                                        seq_lens, scale=scale, window=window, sinks=sinks, parts=1)
        if (self.cpu_decode_kernels is not None and self.cpp_decode and token_weights is None
                and cpu_attention.supports(q, k_cache)):
            return cpu_attention.paged_decode_attention(self.cpu_decode_kernels, q, k_cache, v_cache, block_tables,
                                                        seq_lens, scale=scale, window=window, sinks=sinks)
        plan = None
        if token_weights is None and q.shape[0]:
            block_size = k_cache.shape[2]
            memo = self._decode
            if memo is None or memo[0] is not block_tables or memo[1] is not seq_lens or memo[2] != block_size:
                memo = self._decode = (block_tables, seq_lens, block_size, {})
            window_to_plan = memo[3]
            if window not in window_to_plan:
                window_to_plan[window] = torch_attention.decode_plan(block_tables, seq_lens, block_size, q.device,
                                                                     window)
            plan = window_to_plan[window]
        return torch_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                                      token_weights=token_weights, window=window, sinks=sinks,
                                                      plan=plan)


class TritonBackend:
    """Triton kernels: KV write, split-K decode attention, and the unified paged kernel
    (`kernels.triton_unified`) for prefill and for steps that mix prefill and decode; absorbed decode of
    multi-head latent attention (`model.deepseek`) through `kernels.triton_mla`.

    ``supports_cuda_graphs``: its launchers never read device memory on the host (no sync), so a decode
    step through them can be captured in a CUDA graph (`engine.cuda_graphs`). The other backends read
    slot or length values back (torch) or loop over sequences on the host (reference)."""

    supports_cuda_graphs = True

    def __init__(self) -> None:
        from kvrelay.kernels import (  # lazily: Triton needs a GPU or TRITON_INTERPRET
            triton_attention,
            triton_long_context,
            triton_mla,
            triton_unified,
        )

        self.write_kv = triton_attention.write_kv
        self.paged_decode_attention = triton_attention.paged_decode_attention
        self.prefill_attention = triton_unified.unified_attention
        self.unified_attention = triton_unified.unified_attention
        self.block_key_summaries = triton_long_context.block_key_summaries
        self.score_blocks = triton_long_context.score_blocks
        self.mla_decode_attention = triton_mla.paged_mla_decode  # `model.deepseek.MlaAttention` decode


BACKEND_NAME_TO_CLASS: dict[str, type] = {"reference": ReferenceBackend, "torch": TorchBackend,
                                          "triton": TritonBackend}


def default_backend_name(device: torch.device) -> str:
    """``triton`` on CUDA, ``torch`` elsewhere."""
    return "triton" if device.type == "cuda" else "torch"


def make_backend(name: str) -> AttentionBackend:
    """Raises ValueError naming the known backends."""
    try:
        return BACKEND_NAME_TO_CLASS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; use one of {sorted(BACKEND_NAME_TO_CLASS)}") from None


def paged_attention(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    batch: AttentionBatch,
    *,
    scale: float,
    layer: int = 0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this layer's new KV into the pool, then attend (with ``batch.kv_hook``'s calls around it).

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (rotary already applied to q and k).
        layer_cache: ``[num_blocks, 2, Hkv, B, D]``, i.e. ``pool[:, layer]``. Mutated.
        batch: the step's `AttentionBatch`.
        layer: this layer's index (for ``batch.kv_hook``).
        window: this layer's sliding window in tokens (>= 1), or None for full causal attention.
        sinks: this layer's float32 ``[Hq]`` attention-sink logits on q's device, or None.
            Both go to every kernel called (unified, prefill, decode); see `kernels.reference`.

    Returns:
        ``[T, Hq, D]``.

    Raises:
        ValueError: ``window``/``sinks`` do not fit, or the hook asks for token weights with either.
    """
    k_cache, v_cache = layer_cache[:, 0], layer_cache[:, 1]
    backend.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    p = batch.num_prefill_tokens
    hook = batch.kv_hook
    prefill_weights, decode_weights = hook.token_weights(layer) if hook is not None else (None, None)
    if batch.step_block_tables is not None and prefill_weights is None and decode_weights is None:
        if hook is not None:
            hook.before_decode(layer, q[p:], layer_cache)
        out = backend.unified_attention(  # type: ignore[attr-defined]
            q, k_cache, v_cache, batch.step_block_tables, batch.step_seq_lens, batch.step_query_start_loc,
            scale=scale, window=window, sinks=sinks)
        if hook is not None:
            hook.after_attention(layer)
        return out
    out = torch.empty_like(q)
    if p:
        out[:p] = backend.prefill_attention(
            q[:p], k_cache, v_cache, batch.prefill_block_tables, batch.prefill_seq_lens,
            batch.prefill_query_start_loc, scale=scale, token_weights=prefill_weights, window=window, sinks=sinks,
        )
    if batch.num_decode_tokens:
        if hook is not None:
            hook.before_decode(layer, q[p:], layer_cache)
        out[p:] = backend.paged_decode_attention(
            q[p:], k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, scale=scale,
            token_weights=decode_weights, window=window, sinks=sinks,
        )
    if hook is not None:
        hook.after_attention(layer)
    return out

