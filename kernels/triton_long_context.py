"""Triton kernels for Quest/InfiniGen-style block selection: per-block key summaries and block scores.

Contracts are those of `kernels.reference` (same signatures, same results up to float rounding; the
summaries are exact). Launchers check shapes, strides, dtypes and devices and raise ValueError naming
the problem. Pool layout (see `kvstore.block_spec`)::

    kv_pool: [num_blocks, L, 2, Hkv, B, D]   (dim 2: 0 keys, 1 values; any strides, last dim 1)

Works on CUDA tensors, or on CPU tensors when Triton runs with ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_attention import FLOAT_DTYPES, INDEX_DTYPES, _check_same_device, _check_tensor, _require


def block_key_summaries(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Quest's per-block key summary: the elementwise min and max of each listed block's keys.

    One program per (listed block, layer, KV head) reduces the block's ``[B, D]`` key tile::

        out[i, l, h, 0, :] = min over rows of kv_pool[block_ids[i], l, 0, h]
        out[i, l, h, 1, :] = max over rows of kv_pool[block_ids[i], l, 0, h]

    Args:
        kv_pool: ``[num_blocks, L, 2, Hkv, B, D]`` float32/bfloat16/float16, last dim contiguous.
        block_ids: ``[n]`` int32/int64; each must be < num_blocks (not checked: it would need a
            device sync). Blocks are assumed full (all B rows are keys).

    Returns:
        float32 ``[n, L, Hkv, 2, D]``, newly allocated, exactly equal to the reference. Nothing is mutated.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, naming which.
    """
    _check_tensor("kv_pool", kv_pool, ndim=6, dtypes=FLOAT_DTYPES)
    _require(kv_pool.shape[2] == 2, f"kv_pool dim 2 must be 2 (keys, values), got shape {tuple(kv_pool.shape)}")
    _require(block_ids.dim() == 1 and block_ids.dtype in INDEX_DTYPES,
             f"block_ids must be 1-D int32/int64, got shape {tuple(block_ids.shape)} {block_ids.dtype}")
    device = _check_same_device(kv_pool=kv_pool, block_ids=block_ids)
    _, num_layers, _, num_kv_heads, block_size, head_dim = kv_pool.shape
    num_listed = block_ids.shape[0]
    out = torch.empty((num_listed, num_layers, num_kv_heads, 2, head_dim), dtype=torch.float32, device=device)
    if num_listed == 0:
        return out
    _block_key_summaries_kernel[(num_listed, num_layers, num_kv_heads)](
        kv_pool, block_ids, out, *kv_pool.stride()[:2], kv_pool.stride(3), kv_pool.stride(4),
        BLOCK_SIZE=block_size, ROWS_PAD=triton.next_power_of_2(block_size),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out


@triton.jit
def _block_key_summaries_kernel(
    pool_ptr: tl.tensor, block_ids_ptr: tl.tensor, out_ptr: tl.tensor,
    stride_p_block: tl.tensor, stride_p_layer: tl.tensor, stride_p_head: tl.tensor, stride_p_row: tl.tensor,
    BLOCK_SIZE: tl.constexpr, ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """One (listed block, layer, KV head): min and max over the B key rows into ``out`` ``[n, L, Hkv, 2, D]``."""
    i = tl.program_id(0)
    layer = tl.program_id(1)
    head = tl.program_id(2)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    r = tl.arange(0, ROWS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)
    mask = (r < BLOCK_SIZE) & (d[None, :] < HEAD_DIM)
    k_ptrs = (pool_ptr + block * stride_p_block + layer * stride_p_layer + head * stride_p_head
              + r * stride_p_row + d[None, :])  # dim 2 index 0: keys
    k = tl.load(k_ptrs, mask=mask, other=0.0).to(tl.float32)
    k_min = tl.min(tl.where(mask, k, float("inf")), axis=0)
    k_max = tl.max(tl.where(mask, k, float("-inf")), axis=0)
    row = ((i.to(tl.int64) * tl.num_programs(1) + layer) * tl.num_programs(2) + head) * (2 * HEAD_DIM)
    tl.store(out_ptr + row + d, k_min, mask=d < HEAD_DIM)
    tl.store(out_ptr + row + HEAD_DIM + d, k_max, mask=d < HEAD_DIM)


def score_blocks(q: torch.Tensor, summaries: torch.Tensor, cand_rows: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Quest's upper bound on each candidate block's attention logits, summed over each KV group's query heads.

    ::

        score[c, g] = scale * sum_{h in group g} sum_d max(q[r, h, d] * min[c, g, d], q[r, h, d] * max[c, g, d])
        r = cand_rows[c];  one program per (candidate c, KV head g)

    Args:
        q: ``[N, Hq, D]`` float32/bfloat16/float16, last dim contiguous; ``Hq`` a multiple of ``Hkv``.
        summaries: float32 ``[C, Hkv, 2, D]``, last dim contiguous (one layer of `block_key_summaries`).
        cand_rows: ``[C]`` int32/int64, each < N (not checked: it would need a device sync).
        scale: softmax scale.

    Returns:
        float32 ``[C, Hkv]``, newly allocated (``[0, Hkv]`` when C is 0). Nothing is mutated.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, naming which.
    """
    _check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _check_tensor("summaries", summaries, ndim=4, dtypes=(torch.float32,))
    _require(cand_rows.dim() == 1 and cand_rows.dtype in INDEX_DTYPES,
             f"cand_rows must be 1-D int32/int64, got shape {tuple(cand_rows.shape)} {cand_rows.dtype}")
    _, num_q_heads, head_dim = q.shape
    num_cands, num_kv_heads = summaries.shape[:2]
    _require(summaries.shape[2:] == (2, head_dim),
             f"summaries shape {tuple(summaries.shape)} does not fit; expected [C, Hkv, 2, {head_dim}]")
    _require(num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
             f"q has {num_q_heads} heads, not a multiple of the summaries' {num_kv_heads} KV heads")
    _require(cand_rows.shape[0] == num_cands,
             f"cand_rows has {cand_rows.shape[0]} rows for {num_cands} candidate blocks")
    device = _check_same_device(q=q, summaries=summaries, cand_rows=cand_rows)
    out = torch.empty((num_cands, num_kv_heads), dtype=torch.float32, device=device)
    if num_cands == 0:
        return out
    group = num_q_heads // num_kv_heads
    _score_blocks_kernel[(num_cands, num_kv_heads)](
        q, summaries, cand_rows, out, scale, *q.stride()[:2], *summaries.stride()[:3],
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out


@triton.jit
def _score_blocks_kernel(
    q_ptr: tl.tensor, summaries_ptr: tl.tensor, cand_rows_ptr: tl.tensor, out_ptr: tl.tensor, scale: tl.tensor,
    stride_q_seq: tl.tensor, stride_q_head: tl.tensor,
    stride_s_cand: tl.tensor, stride_s_head: tl.tensor, stride_s_minmax: tl.tensor,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """One (candidate, KV head): the group's ``[G, D]`` queries against the block's min/max key rows."""
    cand = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(cand_rows_ptr + cand).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    d_valid = d < HEAD_DIM
    q_ptrs = q_ptr + row * stride_q_seq + (kv_head * GROUP + g)[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=(g[:, None] < GROUP) & d_valid[None, :], other=0.0).to(tl.float32)
    s_row = summaries_ptr + cand.to(tl.int64) * stride_s_cand + kv_head * stride_s_head + d
    k_min = tl.load(s_row, mask=d_valid, other=0.0)
    k_max = tl.load(s_row + stride_s_minmax, mask=d_valid, other=0.0)
    bound = tl.maximum(q * k_min[None, :], q * k_max[None, :])  # padding contributes max(0, 0) = 0
    tl.store(out_ptr + cand.to(tl.int64) * tl.num_programs(1) + kv_head, tl.sum(tl.sum(bound, axis=1), axis=0) * scale)
