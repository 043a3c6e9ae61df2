"""Triton kernel for absorbed multi-head latent attention decode (DeepSeek) over paged latent rows.

Contract: `kernels.reference.paged_mla_decode` (same signature, same result up to float rounding). The cache is
one layer's plane of an MLA pool (`kvstore.block_spec`, one plane of one "head")::

    latent_cache: [num_blocks, block_size_tokens, W]      a row = [c (kv_lora_rank) | k_rope (W - rank)]
    q:            [N, Hq, W]                               per head [q_nope · W_UK | q_rope]

Every query head reads the same rows, so one program takes ``BLOCK_H`` heads of one sequence over one split of
its tokens and loads each row once for all of them (the GQA kernel's group, here as wide as the heads)::

    stage 1: grid (N, cdiv(Hq, BLOCK_H), S): scores q_c·cᵀ + q_r·k_ropeᵀ (the latent and rope parts as two dots,
             each padded to a power of two on its own), online softmax in float32, acc += p·c
             -> partial (max, sum, acc [rank]) per (sequence, head, split) in float32 scratch
    stage 2: `kernels.triton_attention`'s split reduction, rows ``rank`` wide

Splits as `kernels.triton_attention.decode_num_splits` chooses them from the block-table width (known on the
host, so a launch is graph-capturable). Works on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_attention import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LOG2E,
    MIN_DOT_DIM,
    TORCH_TO_TL_DTYPE,
    _reduce_splits_kernel,
    _require,
    decode_num_splits,
)
from triton.runtime.interpreter import InterpretedFunction

BLOCK_HEADS = 16  # query heads per program (tl.dot needs >= 16 rows)
TILE_TOKENS = 32  # latent rows per loop iteration; may span several blocks


def paged_mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA for one query token per sequence (see module doc and `kernels.reference.paged_mla_decode`).

    Args:
        q: ``[N, Hq, W]`` float, last dim contiguous.
        latent_cache: ``[num_blocks, B, W]`` float of q's dtype or another float dtype (any strides, last dim
            contiguous).
        block_tables: ``[N, max_blocks]`` int32/int64; seq_lens: ``[N]`` int32/int64, each in
            ``1..max_blocks * B`` (not checked: that would need a device sync).
        kv_lora_rank: the latent's width, ``0 < kv_lora_rank < W``.
        scale: the softmax scale.

    Returns:
        ``[N, Hq, kv_lora_rank]`` in ``q.dtype``, newly allocated.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, naming which.
    """
    _require(q.dim() == 3 and q.dtype in FLOAT_DTYPES and q.stride(-1) == 1,
             f"q must be [N, Hq, W] float with a contiguous last dim, got {tuple(q.shape)} {q.dtype}")
    _require(latent_cache.dim() == 3 and latent_cache.dtype in FLOAT_DTYPES and latent_cache.stride(-1) == 1,
             f"latent_cache must be [num_blocks, B, W] float with a contiguous last dim, got "
             f"{tuple(latent_cache.shape)} {latent_cache.dtype}")
    num_seqs, num_heads, width = q.shape
    _require(latent_cache.shape[2] == width, f"q's width {width} != latent_cache's {latent_cache.shape[2]}")
    _require(0 < kv_lora_rank < width, f"kv_lora_rank {kv_lora_rank} must be in 1..{width - 1}")
    _require(block_tables.dim() == 2 and block_tables.dtype in INDEX_DTYPES and block_tables.shape[0] == num_seqs,
             f"block_tables must be [{num_seqs}, max_blocks] int32/int64, got {tuple(block_tables.shape)} "
             f"{block_tables.dtype}")
    _require(seq_lens.dim() == 1 and seq_lens.dtype in INDEX_DTYPES and seq_lens.shape[0] == num_seqs,
             f"seq_lens must be [{num_seqs}] int32/int64, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    _require(len({t.device for t in (q, latent_cache, block_tables, seq_lens)}) == 1,
             "q, latent_cache, block_tables and seq_lens must be on one device")
    device = q.device
    out = torch.empty((num_seqs, num_heads, kv_lora_rank), dtype=q.dtype, device=device)
    if num_seqs == 0:
        return out
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    block_size = latent_cache.shape[1]
    num_splits = decode_num_splits(max(1, block_tables.shape[1] * block_size))
    rope = width - kv_lora_rank
    rank_pad = max(MIN_DOT_DIM, triton.next_power_of_2(kv_lora_rank))
    rope_pad = max(MIN_DOT_DIM, triton.next_power_of_2(rope))
    # The interpreter multiplies bf16 as raw integers in tl.dot, and mixed dtypes need float32 anyway.
    interpreted = isinstance(_mla_decode_split_kernel, InterpretedFunction)
    dot_dtype = tl.float32 if interpreted or q.dtype != latent_cache.dtype else TORCH_TO_TL_DTYPE[q.dtype]
    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((num_seqs, num_heads, num_splits, kv_lora_rank), dtype=torch.float32, device=device)
    _mla_decode_split_kernel[(num_seqs, triton.cdiv(num_heads, BLOCK_HEADS), num_splits)](
        q, latent_cache, block_tables, seq_lens, part_max, part_sum, part_acc,
        scale * LOG2E, block_tables.shape[1], num_heads, *q.stride()[:2], *latent_cache.stride()[:2],
        block_tables.stride(0),
        RANK=kv_lora_rank, RANK_PAD=rank_pad, ROPE=rope, ROPE_PAD=rope_pad, BLOCK_H=BLOCK_HEADS,
        BLOCK_SIZE=block_size, TILE=TILE_TOKENS, DOT_DTYPE=dot_dtype,
    )
    _reduce_splits_kernel[(num_seqs, num_heads)](
        part_max, part_sum, part_acc, out, part_max, part_max, *out.stride()[:2],
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=kv_lora_rank, DIM_PAD=triton.next_power_of_2(kv_lora_rank), STORE_LSE=False, HAS_SINKS=False,
    )
    return out


@triton.jit
def _mla_decode_split_kernel(
    q_ptr: tl.tensor, cache_ptr: tl.tensor, block_tables_ptr: tl.tensor, seq_lens_ptr: tl.tensor,
    part_max_ptr: tl.tensor, part_sum_ptr: tl.tensor, part_acc_ptr: tl.tensor,
    qk_scale_log2: tl.tensor, max_blocks: tl.tensor, num_heads: tl.tensor,
    stride_q_seq: tl.tensor, stride_q_head: tl.tensor, stride_c_block: tl.tensor, stride_c_row: tl.tensor,
    stride_bt_seq: tl.tensor,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Stage 1: partial softmax of ``BLOCK_H`` heads of one sequence over one split (scores in base 2)."""
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE) * TILE
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = h < num_heads
    r = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    q_rows = q_ptr + seq.to(tl.int64) * stride_q_seq + h[:, None] * stride_q_head
    q_c = tl.load(q_rows + r[None, :], mask=h_valid[:, None] & (r[None, :] < RANK), other=0.0).to(DOT_DTYPE)
    q_r = tl.load(q_rows + RANK + e[None, :], mask=h_valid[:, None] & (e[None, :] < ROPE), other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in tl.range(start, end, TILE):
        t = tile_start + tl.arange(0, TILE)
        t_valid = t < end
        block_idx = t // BLOCK_SIZE
        block = tl.load(block_table + block_idx, mask=t_valid & (block_idx < max_blocks), other=0).to(tl.int64)
        rows = cache_ptr + block[:, None] * stride_c_block + (t % BLOCK_SIZE)[:, None] * stride_c_row
        c = tl.load(rows + r[None, :], mask=t_valid[:, None] & (r[None, :] < RANK), other=0.0).to(DOT_DTYPE)
        k_r = tl.load(rows + RANK + e[None, :], mask=t_valid[:, None] & (e[None, :] < ROPE), other=0.0).to(DOT_DTYPE)
        s = (tl.dot(q_c, tl.trans(c), input_precision="ieee")
             + tl.dot(q_r, tl.trans(k_r), input_precision="ieee")) * qk_scale_log2  # [BLOCK_H, TILE]
        s = tl.where(t_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision="ieee")
        m_i = m_new

    # Scratch layout [N, Hq, S] and [N, Hq, S, RANK]; an empty split leaves (-inf, 0, 0).
    part = (seq * num_heads + h).to(tl.int64) * num_splits + split
    tl.store(part_max_ptr + part, m_i, mask=h_valid)
    tl.store(part_sum_ptr + part, l_i, mask=h_valid)
    tl.store(part_acc_ptr + part[:, None] * RANK + r[None, :], acc, mask=h_valid[:, None] & (r[None, :] < RANK))
