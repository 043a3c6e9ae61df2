"""Batched paged attention in plain torch, no per-sequence loop: the CPU serving path.

Same contracts as `kernels.reference` (shapes, layouts, causal rules); the reference stays the oracle.

Prefill gathers one step's sequences into one padded batch and makes one fused
``scaled_dot_product_attention`` call (SDPA accumulates in float32 for bf16 inputs)::

    k_cache [num_blocks, Hkv, B, D] ──blocks of each sequence──▶ K [N, Hkv, M·B, D]
    q (flat [T, Hq, D], ragged)     ──scatter by (sequence, row)──▶ [N, Hq, Qmax, D]
    mask [N, 1, Qmax, M·B]: query row r of sequence i (at position ctx_i + r) sees keys 0 .. ctx_i + r

Padded query rows see key 0 only (so they stay finite) and are dropped. GQA goes through
``enable_gqa`` (no repeated KV heads). Chunks of very different lengths go in separate calls (see
`prefill_attention`), so a long chunk does not pad many short ones.

Decode reads every cached token once per step, so it avoids copies of the KV: blocks are gathered
as they lie (``[N·M, Hkv, B, D]``, one pass) and attended block by block with batched matmuls::

    scores[n·M+m, h, g, :] = q[n, h·G+g] · K_block(n, m, h)ᵀ     [N·M, Hkv, G, B]   (G = Hq / Hkv)
    softmax over each sequence's M·B keys (masked past its length), in float32
    out[n, h·G+g] = Σ_m  p[n·M+m, h, g, :] · V_block(n, m, h)

With ``token_weights`` (H2O needs the softmax weights) both functions hand over to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """Where `write_kv` puts a step's tokens: ``blocks``/``offsets`` ``[T]`` int64, or None when a slot is
    negative (padding: the reference's masked write is used). The same for every layer of a step."""

    blocks: torch.Tensor | None
    offsets: torch.Tensor | None


def slot_plan(slot_mapping: torch.Tensor, block_size: int) -> SlotPlan:
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        return SlotPlan(None, None)
    slots = slot_mapping.long()
    return SlotPlan(slots // block_size, slots % block_size)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
    *, plan: SlotPlan | None = None,
) -> None:
    """`kernels.reference.write_kv` without the padding mask when no slot is negative (the serving case:
    a step's slots are all real), which saves a boolean gather per tensor and layer. ``plan``: the step's
    `slot_plan` (computed here when None)."""
    plan = plan if plan is not None else slot_plan(slot_mapping, k_cache.shape[2])
    if plan.blocks is None or plan.offsets is None:
        reference.write_kv(k_cache, v_cache, key, value, slot_mapping)
        return
    k_cache[plan.blocks, :, plan.offsets] = key.to(k_cache.dtype)
    v_cache[plan.blocks, :, plan.offsets] = value.to(v_cache.dtype)


def _own_block_ids(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                   block_size: int) -> torch.Tensor:
    """``[N, num_blocks]`` int64 block ids; entries past a sequence's own blocks (the contract lets
    them hold anything) read block 0 instead, and the mask hides those keys."""
    table = block_tables[:, :num_blocks].to(device=seq_lens.device, dtype=torch.int64)
    own = torch.arange(num_blocks, device=table.device)[None, :] * block_size < seq_lens[:, None]
    return torch.where(own, table, 0)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[N, Hkv, num_blocks·B, D]``: each sequence's first ``num_blocks`` blocks, in token order."""
    _, h, b, d = cache.shape
    ids = _own_block_ids(block_tables, seq_lens, num_blocks, b)
    # index_select over the flat table: ~3x faster than advanced indexing on a strided layer view.
    blocks = cache.index_select(0, ids.reshape(-1)).view(ids.shape[0], num_blocks, h, b, d)
    return blocks.transpose(1, 2).reshape(ids.shape[0], h, num_blocks * b, d)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """The per-step part of decode attention, the same for every layer: ``m`` blocks per sequence,
    ``ids`` ``[N·m]`` int64 block ids to read, ``past_end`` ``[N, m·B]`` bool (keys past each length)."""

    m: int
    ids: torch.Tensor
    past_end: torch.Tensor


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                device: torch.device) -> DecodePlan:
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    m = -(-int(seq_lens.max()) // block_size)
    ids = _own_block_ids(block_tables, seq_lens, m, block_size).reshape(-1)
    past_end = torch.arange(m * block_size, device=device)[None, :] >= seq_lens[:, None]
    return DecodePlan(m, ids, past_end)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    token_weights: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """`kernels.reference.paged_decode_attention`, block by block for all sequences at once (module doc).
    ``plan``: the step's `decode_plan` for these tables and lengths (computed here when None)."""
    if token_weights is not None:
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                                token_weights=token_weights)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    n, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    plan = plan if plan is not None else decode_plan(block_tables, seq_lens, block_size, q.device)
    m = plan.m
    k, v = k_cache.index_select(0, plan.ids), v_cache.index_select(0, plan.ids)  # [N·M, Hkv, B, D]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    q_blocks = q.view(n, 1, num_kv_heads, group, head_dim).expand(n, m, num_kv_heads, group, head_dim)
    scores = torch.matmul(q_blocks.reshape(n * m, num_kv_heads, group, head_dim), k.transpose(-1, -2))
    scores = scores.float().view(n, m, num_kv_heads, group, block_size).permute(0, 2, 3, 1, 4)
    scores = scores.reshape(n, num_kv_heads, group, m * block_size) * scale
    probs = torch.softmax(scores.masked_fill(plan.past_end[:, None, None, :], float("-inf")), dim=-1)
    probs = probs.to(q.dtype).view(n, num_kv_heads, group, m, block_size).permute(0, 3, 1, 2, 4)
    out = torch.matmul(probs.reshape(n * m, num_kv_heads, group, block_size), v)  # [N·M, Hkv, G, D]
    return out.view(n, m, num_heads, head_dim).float().sum(dim=1).to(q.dtype)


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
    """`kernels.reference.prefill_attention` through one SDPA call per group of similar chunk lengths.

    Padding every chunk to the longest one wastes work when a long chunk shares the step with many
    short ones (a new prompt next to follow-ups over a cached prefix), so sequences are grouped by
    chunk length, each group padding at most `MAX_PADDING_FACTOR` times its real query rows.
    """
    if token_weights is not None:
        return reference.prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                           scale=scale, token_weights=token_weights)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    starts = query_start_loc.tolist()
    groups = _padding_groups([b - a for a, b in zip(starts, starts[1:])])
    if len(groups) == 1:
        return _prefill_padded(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale)
    out = torch.empty_like(q)
    for members in groups:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=q.device) for i in members])
        lens = [starts[i + 1] - starts[i] for i in members]
        sub_starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=q.device)
        index = torch.tensor(members, device=block_tables.device)
        out[rows] = _prefill_padded(q[rows], k_cache, v_cache, block_tables.index_select(0, index),
                                    seq_lens.index_select(0, index.to(seq_lens.device)), sub_starts, scale=scale)
    return out


MAX_PADDING_FACTOR = 1.5


def _padding_groups(q_lens: list[int]) -> list[list[int]]:
    """Sequence indices grouped by chunk length (longest first) so that each group's padded rows
    (members × its longest chunk) stay within `MAX_PADDING_FACTOR` × its real rows."""
    order = sorted((i for i, n in enumerate(q_lens) if n > 0), key=lambda i: -q_lens[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * q_lens[groups[-1][0]] <= MAX_PADDING_FACTOR * (real + q_lens[i]):
            groups[-1].append(i)
            real += q_lens[i]
        else:
            groups.append([i])
            real = q_lens[i]
    return groups


def _prefill_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, scale: float) -> torch.Tensor:
    """All sequences padded to the longest chunk, one SDPA call (see module doc)."""
    total, num_heads, head_dim = q.shape
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
