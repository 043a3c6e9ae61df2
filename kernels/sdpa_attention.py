"""Batched paged attention with ``torch.nn.functional.scaled_dot_product_attention``: the CPU serving path.

Same contracts as `kernels.reference` (shapes, layouts, causal rules); the reference stays the oracle.
Instead of a loop over sequences, one step's sequences are gathered into one padded batch::

    k_cache [num_blocks, Hkv, B, D] ──cache[block_tables[:, :M]]──▶ [N, M, Hkv, B, D] ──▶ K [N, Hkv, M·B, D]
    q (flat [T, Hq, D], ragged)     ──scatter by (sequence, row)──▶ [N, Hq, Qmax, D]
    mask [N, 1, Qmax, M·B]: query row r of sequence i (at position ctx_i + r) sees keys 0 .. ctx_i + r

and one fused SDPA call attends, with no repeated KV heads: in decode a KV group's query heads are
query rows of that KV head; in prefill GQA goes through ``enable_gqa``. SDPA accumulates
in float32 for bf16 inputs. Padded query rows see key 0 only (so they stay finite) and are dropped.
With ``token_weights`` (H2O needs the softmax weights, which SDPA does not return) both functions
hand over to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[N, Hkv, num_blocks·B, D]``: each sequence's first ``num_blocks`` blocks, in token order.

    Table entries past a sequence's own blocks may hold anything (the contract ignores them): they
    read block 0 instead, and the mask hides those keys.
    """
    block_size = cache.shape[2]
    table = block_tables[:, :num_blocks].long()
    own = torch.arange(num_blocks, device=table.device)[None, :] * block_size < seq_lens[:, None]
    n, m = table.shape
    _, h, b, d = cache.shape
    # index_select over the flat table: ~3x faster than advanced indexing on a strided layer view.
    blocks = cache.index_select(0, torch.where(own, table, 0).reshape(-1)).view(n, m, h, b, d)
    return blocks.transpose(1, 2).reshape(n, h, m * b, d)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.reference.paged_decode_attention`, batched through one SDPA call (see module doc)."""
    if token_weights is not None:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                                token_weights=token_weights)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    block_size = k_cache.shape[2]
    seq_lens = seq_lens.to(device=q.device, dtype=torch.int64)
    num_blocks = -(-int(seq_lens.max()) // block_size)
    k = _gather(k_cache, block_tables, seq_lens, num_blocks)
    v = _gather(v_cache, block_tables, seq_lens, num_blocks)
    positions = torch.arange(num_blocks * block_size, device=q.device)
    mask = (positions.unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    # One query token: a KV group's query heads are just more query rows (faster than enable_gqa here).
    grouped = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernels.reference.prefill_attention`, batched through one SDPA call (see module doc)."""
    if token_weights is not None:
        return reference.prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                           scale=scale, token_weights=token_weights)
    total, num_heads, head_dim = q.shape
    if total == 0:
        return torch.empty_like(q)
    device = q.device
    starts = query_start_loc.to(device=device, dtype=torch.int64)
    lens = seq_lens.to(device=device, dtype=torch.int64)
    q_lens = starts[1:] - starts[:-1]
    ctx_lens = lens - q_lens
    n = lens.shape[0]
    block_size = k_cache.shape[2]
    num_blocks = -(-int(lens.max()) // block_size)
    k, v = _gather(k_cache, block_tables, lens, num_blocks), _gather(v_cache, block_tables, lens, num_blocks)
    seq_of_token = torch.repeat_interleave(torch.arange(n, device=device), q_lens, output_size=total)
    row_of_token = torch.arange(total, device=device) - starts[seq_of_token]
    max_rows = int(q_lens.max())
    padded = q.new_zeros(n, max_rows, num_heads, head_dim)
    padded[seq_of_token, row_of_token] = q
    rows = torch.arange(max_rows, device=device)
    keys = torch.arange(num_blocks * block_size, device=device)
    last_key = ctx_lens[:, None] + rows[None, :]  # [N, Qmax]: the newest key each query row may see
    mask = keys[None, None, :] <= last_key[:, :, None]  # [N, Qmax, S]
    mask[:, :, 0] = True  # padded rows (r >= q_lens[i]) stay finite; real rows see key 0 anyway
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[seq_of_token, row_of_token]
