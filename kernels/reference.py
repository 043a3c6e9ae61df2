"""Plain-torch references, one per kernel. The CPU serving path and the oracle in tests.

Cache layout (a view of one layer of the pool, see `kvstore.block_spec`)::

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size_tokens, head_dim]
    token at position p of a sequence lives in block block_table[p // B], row p % B
    slot = block_id * B + offset

GQA: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
All attention math accumulates in float32 and returns the query's dtype.
"""

from __future__ import annotations

import torch


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its slot. Mutates ``k_cache`` and ``v_cache``.

    Args:
        k_cache, v_cache: ``[num_blocks, H, B, D]``.
        key, value: ``[T, H, D]``.
        slot_mapping: ``[T]`` integer slots; a negative slot skips that token (padding).
    """
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence: ``[seq_len, H, D]``."""
    block_size = cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, H, B, D]
    return blocks.permute(0, 2, 1, 3).reshape(num_blocks * block_size, cache.shape[1], cache.shape[3])[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None) -> torch.Tensor:
    """q ``[Tq, Hq, D]``, k/v ``[S, Hkv, D]`` → ``[Tq, Hq, D]`` (float32 math).

    ``causal_offset``: query row ``i`` sits at position ``causal_offset + i`` and sees keys ``0..that``;
    None means every query sees every key.
    """
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Tq, S]
    if causal_offset is not None:
        tq, s = q.shape[0], k.shape[0]
        pos_q = torch.arange(tq, device=q.device).unsqueeze(1) + causal_offset
        pos_k = torch.arange(s, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending over that sequence's cached tokens.

    All sequences are gathered into one padded batch (positions past a sequence's length are
    masked), so the CPU decode step is a few batched matmuls rather than a Python loop.

    Args:
        q: ``[N, Hq, D]``, the query of each sequence's newest token (whose KV is already written).
        k_cache, v_cache: ``[num_blocks, Hkv, B, D]``.
        block_tables: ``[N, max_blocks]`` int; entries past a sequence's length are ignored.
        seq_lens: ``[N]`` int, tokens to attend over (≥ 1), the newest included.
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``.
    """
    n, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    if n == 0:
        return torch.empty_like(q)
    lens = seq_lens.to(q.device).long()
    num_blocks = (int(lens.max()) + bs - 1) // bs
    table = block_tables[:, :num_blocks].long().to(q.device)  # [N, nb]
    used = torch.arange(num_blocks, device=q.device)[None, :] < ((lens + bs - 1) // bs)[:, None]
    table = torch.where(used, table, torch.zeros_like(table))  # entries past a sequence may be garbage

    def gather(cache: torch.Tensor) -> torch.Tensor:  # → [N, Hkv, nb·B, D] float32
        return cache[table].permute(0, 2, 1, 3, 4).reshape(n, hkv, num_blocks * bs, d).float()

    k, v = gather(k_cache), gather(v_cache)
    qf = q.float().reshape(n, hkv, hq // hkv, d)  # query heads grouped by the KV head they read
    scores = torch.matmul(qf, k.transpose(2, 3)) * scale  # [N, Hkv, group, S]
    pad = torch.arange(num_blocks * bs, device=q.device)[None, :] >= lens[:, None]
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [N, Hkv, group, D]
    return out.reshape(n, hq, d).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over a cached prefix plus themselves (chunked prefill).

    ::

        sequence i:  [ cached prefix .......... | new tokens (queries) ]
                      0                 ctx_len                 seq_lens[i]
        queries: q[query_start_loc[i] : query_start_loc[i+1]], ctx_len = seq_lens[i] - num_queries

    The new tokens' KV must already be written into the cache.

    Args:
        q: ``[T_total, Hq, D]``.
        k_cache, v_cache: ``[num_blocks, Hkv, B, D]``.
        block_tables: ``[N, max_blocks]`` int.
        seq_lens: ``[N]`` int, total tokens of each sequence after this step.
        query_start_loc: ``[N + 1]`` int, cumulative query counts starting at 0.
        scale: softmax scale.

    Returns:
        ``[T_total, Hq, D]`` in ``q.dtype``.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len)
        v = gather_kv(v_cache, block_tables[i], seq_len)
        out[a:b] = _attend(q[a:b], k, v, scale, seq_len - (b - a))
    return out
