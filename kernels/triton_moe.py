"""Fused mixture-of-experts in Triton: a grouped GEMM over expert-sorted blocks of (token, k) rows, with the
contract of `kernels.moe_reference.fused_experts_reference` (the design of vLLM's ``fused_moe``).

Routing gives ``P = T * k`` rows, one per (token, k) pair, numbered ``pair = t * k + j``.
`moe_align_block_size` groups the pairs by expert and pads each expert's group to a multiple of ``BLOCK_M``
with the sentinel ``P``, so that every block of ``BLOCK_M`` sorted rows belongs to one expert::

    sorted_token_ids: [ e0 e0 e0 P | e2 e2 e2 e2 | e2 P P P | e3 P P P | P P P P ... ]   BLOCK_M = 4
    expert_ids:       [    0       |      2      |    2     |    3     |  E  ...   ]       (e1 has no rows)
                      0                                              num_tokens_post_padded      capacity

Two launches over the same blocks, one program per (block, ``BLOCK_N`` output columns); programs on blocks
past ``num_tokens_post_padded`` return at once, so the grid depends only on shapes (no host sync)::

    gate_up:  act[pair, n] = act(x[pair // k] @ w_gate_up[e, n].T + b, x[pair // k] @ w_gate_up[e, I + n].T + b)
              each program holds a gate and an up accumulator for the same columns n, so the
              activation is the epilogue; act is stored [P, I] in x.dtype
    down:     y[pair, :] = topk_weights[pair] * (act[pair] @ w_down[e].T + b_down[e])     [P, H] float32
    out = y.view(T, k, H).sum(1).to(x.dtype)

Accumulation is float32 in both GEMMs and in the sum over ``k``; inputs of ``tl.dot`` are in ``x.dtype``
on the GPU (float32 at IEEE precision, no TF32) and float32 under the interpreter.

Works on CUDA tensors, or on CPU tensors when Triton runs with ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_attention import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MIN_DOT_DIM,
    TORCH_TO_TL_DTYPE,
    _check_same_device,
    _check_tensor,
    _require,
)
from triton.runtime.interpreter import InterpretedFunction

# Activation name -> the kernel's ACTIVATION constexpr; the keys of `kernels.moe_reference.ACTIVATIONS` (tested).
ACTIVATION_CODES = {"silu": 0, "swiglu_oai": 1}
# Largest BLOCK_M: above it a block's rows no longer fit the tensor cores' sweet spot.
MAX_BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


class MoeAlignment(NamedTuple):
    """The (token, k) rows of one routing, sorted by expert into blocks (see the module docstring).

    ``sorted_token_ids``: ``[capacity]`` int32 pair ids ``t * k + j``, grouped by ascending expert, ascending
    within an expert; each expert's group starts at a multiple of ``block_m`` and is padded with ``P = T * k``.
    ``expert_ids``: ``[capacity // block_m]`` int32, the expert of each block; ``E`` for blocks at or past
    ``num_tokens_post_padded``. ``num_tokens_post_padded``: ``[1]`` int32, the padded row count (a tensor, so
    reading it is the caller's sync).
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


class MoeTiles(NamedTuple):
    """Tile shape of both GEMMs: ``block_m`` sorted rows x ``block_n`` output columns, ``block_k`` per step."""

    block_m: int
    block_n: int
    block_k: int


def tile_config(num_pairs: int, num_experts: int) -> MoeTiles:
    """Tiles for ``num_pairs`` (token, k) rows over ``num_experts``: ``block_m`` is the mean rows per expert
    rounded up to a power of two, clamped to ``[16, MAX_BLOCK_M]`` (16 is the least `tl.dot` takes), so
    decode steps waste few padded rows and prefill steps get full tiles."""
    rows_per_expert = triton.cdiv(max(num_pairs, 1), num_experts)
    block_m = min(MAX_BLOCK_M, max(MIN_DOT_DIM, triton.next_power_of_2(rows_per_expert)))
    return MoeTiles(block_m=block_m, block_n=BLOCK_N, block_k=BLOCK_K)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the (token, k) pairs of ``topk_ids`` by expert into blocks of ``block_m`` rows.

    Args:
        topk_ids: ``[T, k]`` int32/int64, values in ``[0, num_experts)`` (not checked: it would need a sync;
            an id out of range fails in ``scatter_add_`` on CPU and is a device-side error on CUDA).
        num_experts: ``E >= 1``.
        block_m: rows per block, ``>= 1``.

    Returns:
        A `MoeAlignment` on ``topk_ids.device``. ``capacity`` is the bound
        ``P + min(E, P) * (block_m - 1)`` rounded up to a multiple of ``block_m``, so it depends on shapes
        only. Torch ops, no host sync. Nothing is mutated.

    Raises:
        ValueError: ``topk_ids`` is not 2-D int32/int64, or ``num_experts`` / ``block_m`` is below 1.
    """
    _require(topk_ids.dim() == 2 and topk_ids.dtype in INDEX_DTYPES,
             f"topk_ids must be 2-D int32/int64, got shape {tuple(topk_ids.shape)} {topk_ids.dtype}")
    _require(num_experts >= 1, f"num_experts must be >= 1, got {num_experts}")
    _require(block_m >= 1, f"block_m must be >= 1, got {block_m}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # pair ids grouped by expert, ascending within one
    experts_sorted = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts_sorted]
    dest = (padded_ends - padded)[experts_sorted] + rank_in_expert

    capacity = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    sorted_token_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    # The first expert whose padded range ends past the block's start; E past the last one.
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return MoeAlignment(sorted_token_ids, expert_ids, padded_ends[-1:].to(torch.int32))


def _check_inputs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None) -> None:
    _check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_tensor("w_gate_up", w_gate_up, ndim=3, dtypes=(x.dtype,))
    _check_tensor("w_down", w_down, ndim=3, dtypes=(x.dtype,))
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    _require(hidden >= 1, f"x shape {tuple(x.shape)} has no hidden dim")
    _require(num_experts >= 1 and inter >= 1 and two_inter % 2 == 0 and w_gate_up.shape[2] == hidden,
             f"w_gate_up shape {tuple(w_gate_up.shape)} is not [E, 2I, H] with E, I >= 1 and H = {hidden} "
             "(x.shape[1])")
    _require(tuple(w_down.shape) == (num_experts, hidden, inter),
             f"w_down shape {tuple(w_down.shape)} != [E, H, I] = {(num_experts, hidden, inter)} from w_gate_up")
    _check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,))
    _check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES)
    _require(topk_weights.shape[0] == num_tokens and topk_weights.shape[1] >= 1,
             f"topk_weights shape {tuple(topk_weights.shape)} is not [T, k] with T = {num_tokens}, k >= 1")
    _require(topk_ids.shape == topk_weights.shape,
             f"topk_ids shape {tuple(topk_ids.shape)} != topk_weights shape {tuple(topk_weights.shape)}")
    tensors = dict(x=x, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights, topk_ids=topk_ids)
    for name, bias, width in (("b_gate_up", b_gate_up, two_inter), ("b_down", b_down, hidden)):
        if bias is not None:
            _check_tensor(name, bias, ndim=2, dtypes=(x.dtype,))
            _require(tuple(bias.shape) == (num_experts, width),
                     f"{name} shape {tuple(bias.shape)} != {(num_experts, width)}")
            tensors[name] = bias
    _check_same_device(**tensors)


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """The experts block of one MoE layer in two grouped-GEMM launches; the contract of
    `kernels.moe_reference.fused_experts_reference` up to float rounding (this one accumulates in float32,
    the reference in ``x.dtype``).

    Args:
        x: ``[T, H]`` float32/bfloat16/float16 (any row stride, last dim contiguous).
        w_gate_up: ``[E, 2I, H]`` in ``x.dtype``, rows ``[0, I)`` gate, ``[I, 2I)`` up (last dim contiguous).
        w_down: ``[E, H, I]`` in ``x.dtype`` (last dim contiguous).
        topk_weights: ``[T, k]`` float32.
        topk_ids: ``[T, k]`` int32/int64 in ``[0, E)`` (not checked, see `moe_align_block_size`).
        b_gate_up, b_down: optional ``[E, 2I]`` / ``[E, H]`` biases in ``x.dtype``.
        activation: ``"silu"`` or ``"swiglu_oai"``; ``swiglu_alpha`` and ``swiglu_limit`` are the latter's.

    Returns:
        ``[T, H]`` in ``x.dtype``, newly allocated. Nothing is mutated.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, or ``activation`` is unknown, naming which.
    """
    _require(activation in ACTIVATION_CODES,
             f"activation {activation!r} is unknown; use one of {sorted(ACTIVATION_CODES)}")
    _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, b_gate_up, b_down)
    num_tokens, hidden = x.shape
    num_experts, top_k = w_gate_up.shape[0], topk_ids.shape[1]
    inter = w_down.shape[2]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = tile_config(num_pairs, num_experts)
    align = moe_align_block_size(topk_ids, num_experts, tiles.block_m)
    num_blocks = align.expert_ids.shape[0]
    # The interpreter multiplies bf16 as raw integers in tl.dot.
    interpreted = isinstance(_gate_up_kernel, InterpretedFunction)
    dot_dtype = tl.float32 if interpreted else TORCH_TO_TL_DTYPE[x.dtype]
    common = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_DTYPE=dot_dtype)

    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    # Without a bias the weight stands in for its pointer; HAS_BIAS keeps it unread.
    b1 = w_gate_up if b_gate_up is None else b_gate_up
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        x, w_gate_up, b1, act, align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded,
        num_pairs, top_k, hidden, inter, float(swiglu_alpha), float(swiglu_limit),
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), b1.stride(0), act.stride(0),
        HAS_BIAS=b_gate_up is not None, ACTIVATION=ACTIVATION_CODES[activation], **common,
    )
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    b2 = w_down if b_down is None else b_down
    weights = topk_weights.reshape(-1)  # [P], pair t * k + j
    _down_kernel[(num_blocks, triton.cdiv(hidden, tiles.block_n))](
        act, w_down, b2, weights, pair_out, align.sorted_token_ids, align.expert_ids,
        align.num_tokens_post_padded, num_pairs, hidden, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), b2.stride(0), pair_out.stride(0),
        HAS_BIAS=b_down is not None, **common,
    )
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


@triton.jit
def _block_rows(sorted_token_ids_ptr: tl.tensor, expert_ids_ptr: tl.tensor, num_pairs: tl.tensor,
                BLOCK_M: tl.constexpr):
    """This program's block: its rows' pair ids (int64), which of them are real (not padding), its expert."""
    pid_m = tl.program_id(0)
    pairs = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return pairs, pairs < num_pairs, expert


@triton.jit
def _gate_up_kernel(
    x_ptr: tl.tensor, w_ptr: tl.tensor, b_ptr: tl.tensor, act_ptr: tl.tensor,
    sorted_token_ids_ptr: tl.tensor, expert_ids_ptr: tl.tensor, num_post_padded_ptr: tl.tensor,
    num_pairs: tl.tensor, top_k: tl.tensor, hidden: tl.tensor, inter: tl.tensor,
    swiglu_alpha: tl.tensor, swiglu_limit: tl.tensor,
    stride_x_tok: tl.tensor, stride_w_expert: tl.tensor, stride_w_row: tl.tensor, stride_b_expert: tl.tensor,
    stride_act_row: tl.tensor,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """One (block, columns [n0, n0 + BLOCK_N) of I): gate and up GEMMs of the block's rows, bias, activation,
    stored to ``act[pair, n]``."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    pairs, row_ok, expert = _block_rows(sorted_token_ids_ptr, expert_ids_ptr, num_pairs, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (pairs // top_k)[:, None] * stride_x_tok
    w_gate = w_ptr + expert * stride_w_expert + n[None, :] * stride_w_row  # W[e, n, :] is output column n
    w_up = w_gate + inter * stride_w_row
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K):
        k = k0 + kk
        k_ok = k < hidden
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        kn_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_gate + k[:, None], mask=kn_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + k[:, None], mask=kn_mask, other=0.0).to(DOT_DTYPE)
        acc_gate += tl.dot(a, wg, input_precision="ieee")
        acc_up += tl.dot(a, wu, input_precision="ieee")
    if HAS_BIAS:
        b_row = b_ptr + expert * stride_b_expert
        acc_gate += tl.load(b_row + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_row + inter + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 0:  # silu
        out = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:  # swiglu_oai
        gate = tl.minimum(acc_gate, swiglu_limit)
        up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * swiglu_alpha))
    act_ptrs = act_ptr + pairs[:, None] * stride_act_row + n[None, :]
    tl.store(act_ptrs, out.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr: tl.tensor, w_ptr: tl.tensor, b_ptr: tl.tensor, topk_weights_ptr: tl.tensor, out_ptr: tl.tensor,
    sorted_token_ids_ptr: tl.tensor, expert_ids_ptr: tl.tensor, num_post_padded_ptr: tl.tensor,
    num_pairs: tl.tensor, hidden: tl.tensor, inter: tl.tensor,
    stride_act_row: tl.tensor, stride_w_expert: tl.tensor, stride_w_row: tl.tensor, stride_b_expert: tl.tensor,
    stride_out_row: tl.tensor,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One (block, columns [n0, n0 + BLOCK_N) of H): ``topk_weight * (act @ w_down[e].T + b_down[e])`` of the
    block's rows, stored float32 to ``out[pair, n]``. ``topk_weights`` is contiguous ``[P]``."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    pairs, row_ok, expert = _block_rows(sorted_token_ids_ptr, expert_ids_ptr, num_pairs, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    kk = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + pairs[:, None] * stride_act_row
    w_cols = w_ptr + expert * stride_w_expert + n[None, :] * stride_w_row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, inter, BLOCK_K):
        k = k0 + kk
        k_ok = k < inter
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc += tl.dot(a, w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_b_expert + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_out_row + n[None, :]
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & n_ok[None, :])
