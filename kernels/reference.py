"""Plain-torch references, one per kernel. The CPU serving path and the oracle in tests.

Cache layout (a view of one layer of the pool, see `kvstore.block_spec`)::

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size_tokens, head_dim]
    token at position p of a sequence lives in block block_table[p // B], row p % B
    slot = block_id * B + offset

GQA: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
All attention math accumulates in float32 and returns the query's dtype.

Sliding window and attention sinks (gpt-oss), as Hugging Face transformers computes them::

    window W:  the query at position i sees the key at position j iff  i - W < j <= i
               (HF: kv_idx > q_idx - sliding_window, and causal); None = full causal attention
    sinks:     one logit per query head, concatenated to that head's *scaled* logits, softmaxed with them
               and dropped:  out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink_h - m)),
               m = max(max_j s_j, sink_h). The sink is not multiplied by the scale.

         positions:  0 ....... i-W | i-W+1 ........ i | i+1 ...
         query i:       hidden     |     visible      | hidden (causal)

A block wholly before a windowed sequence's window is never read, and its block-table entry may hold
anything (a freed block's id). Token weights (H2O) are not defined together with a window or sinks.
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
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, *, first_block: int = 0
) -> torch.Tensor:
    """Tokens ``first_block * B .. seq_len - 1`` of one sequence: ``[seq_len - first_block * B, H, D]``.
    Table entries before ``first_block`` are not read."""
    block_size = cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[first_block:num_blocks].long()]  # [n, H, B, D]
    tokens = blocks.permute(0, 2, 1, 3).reshape(blocks.shape[0] * block_size, cache.shape[1], cache.shape[3])
    return tokens[: seq_len - first_block * block_size]


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores``, with ``sinks`` (broadcastable to ``scores[..., :1]``)
    as one more logit per row that takes its share of the weight and is then dropped (HF gpt-oss)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int, *,
    key_offset: int = 0, window: int | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[Tq, Hq, D]``, k/v ``[S, Hkv, D]`` → (out ``[Tq, Hq, D]``, probs ``[Hq, Tq, S]`` float32).

    Query row ``i`` sits at position ``causal_offset + i``, key row ``j`` at ``key_offset + j``; a query
    sees the keys at positions ``(its position - window, its position]`` (no lower bound when None).
    ``sinks``: float32 ``[Hq]`` or None.
    """
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Tq, S]
    tq, s = q.shape[0], k.shape[0]
    pos_q = torch.arange(tq, device=q.device).unsqueeze(1) + causal_offset
    pos_k = torch.arange(s, device=q.device).unsqueeze(0) + key_offset
    hidden = pos_k > pos_q
    if window is not None:
        hidden = hidden | (pos_k <= pos_q - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1))
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype), probs


def check_token_weights(
    token_weights: torch.Tensor, *, num_seqs: int, num_kv_heads: int, min_width: int, device: torch.device
) -> None:
    """Raise ValueError unless ``token_weights`` is a float32 ``[num_seqs, num_kv_heads, W >= min_width]``
    tensor on ``device``."""
    if token_weights.dtype != torch.float32:
        raise ValueError(f"token_weights.dtype is {token_weights.dtype}; use torch.float32")
    if token_weights.dim() != 3 or tuple(token_weights.shape[:2]) != (num_seqs, num_kv_heads):
        raise ValueError(f"token_weights shape {tuple(token_weights.shape)} does not fit; "
                         f"expected [{num_seqs}, {num_kv_heads}, W] (sequences, KV heads, W >= max(seq_lens))")
    if token_weights.shape[2] < min_width:
        raise ValueError(f"token_weights is too narrow: width {token_weights.shape[2]} < max(seq_lens) "
                         f"{min_width}; allocate W >= the longest sequence")
    if token_weights.device != device:
        raise ValueError(f"token_weights is on {token_weights.device}, q on {device}; put them on one device")


def check_window_and_sinks(
    window: int | None, sinks: torch.Tensor | None, *, num_q_heads: int, device: torch.device,
    token_weights: torch.Tensor | None,
) -> None:
    """Raise ValueError unless ``window`` is None or an int >= 1, ``sinks`` is None or a float32 ``[num_q_heads]``
    tensor on ``device``, and ``token_weights`` is None whenever either is given. Reads no tensor values."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window is {window!r}; use None (full causal attention) or a token count >= 1")
    if sinks is not None:
        if sinks.dtype != torch.float32:
            raise ValueError(f"sinks.dtype is {sinks.dtype}; use torch.float32 (sinks.float())")
        if tuple(sinks.shape) != (num_q_heads,):
            raise ValueError(f"sinks shape {tuple(sinks.shape)} does not fit; expected [{num_q_heads}] "
                             "(one logit per query head)")
        if sinks.device != device:
            raise ValueError(f"sinks is on {sinks.device}, q on {device}; put them on one device")
    if token_weights is not None and (window is not None or sinks is not None):
        raise ValueError("token weights with a sliding window or attention sinks are not supported; "
                         "use a KV policy without token weights (not H2O) for this model")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    token_weights: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
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
        token_weights: optional float32 ``[N, Hkv, W]`` output, ``W >= max(seq_lens)``, on q's device
            (for H2O-style eviction). Overwritten: ``token_weights[i, g, j]`` is the softmax weight
            sequence ``i``'s query gives cached token ``j``, summed over KV head ``g``'s query heads
            (so each ``[i, g]`` row sums to ``Hq / Hkv``); ``j >= seq_lens[i]`` is 0.
        window: sliding window in tokens (>= 1): the query (position ``seq_lens[i] - 1``) sees positions
            ``seq_lens[i] - window .. seq_lens[i] - 1``; None = every cached token. Table entries of blocks
            wholly before the window are not read (block 0 is read in their place, and masked).
        sinks: float32 ``[Hq]`` attention-sink logits on q's device (unscaled), or None (module doc).

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``; the same whether or not ``token_weights`` is given.

    Raises:
        ValueError: ``token_weights`` has the wrong dtype, shape, width or device; ``window`` or ``sinks``
            do not fit; ``token_weights`` together with ``window`` or ``sinks``.
    """
    n, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    check_window_and_sinks(window, sinks, num_q_heads=hq, device=q.device, token_weights=token_weights)
    lens = seq_lens.to(q.device).long()
    max_len = int(lens.max()) if n else 0
    if token_weights is not None:
        check_token_weights(token_weights, num_seqs=n, num_kv_heads=hkv, min_width=max_len, device=q.device)
    if n == 0:
        return torch.empty_like(q)
    num_blocks = (max_len + bs - 1) // bs
    table = block_tables[:, :num_blocks].long().to(q.device)  # [N, nb]
    block_idx = torch.arange(num_blocks, device=q.device)[None, :]
    used = block_idx < ((lens + bs - 1) // bs)[:, None]
    if window is not None:
        first = (lens - window).clamp(min=0)  # [N] the first visible position
        used = used & ((block_idx + 1) * bs > first[:, None])
    table = torch.where(used, table, torch.zeros_like(table))  # entries outside a sequence may be garbage

    def gather(cache: torch.Tensor) -> torch.Tensor:  # → [N, Hkv, nb·B, D] float32
        return cache[table].permute(0, 2, 1, 3, 4).reshape(n, hkv, num_blocks * bs, d).float()

    k, v = gather(k_cache), gather(v_cache)
    qf = q.float().reshape(n, hkv, hq // hkv, d)  # query heads grouped by the KV head they read
    scores = torch.matmul(qf, k.transpose(2, 3)) * scale  # [N, Hkv, group, S]
    positions = torch.arange(num_blocks * bs, device=q.device)[None, :]
    pad = positions >= lens[:, None]
    if window is not None:
        pad = pad | (positions < first[:, None])
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, hkv, hq // hkv, 1))
    out = torch.matmul(probs, v)  # [N, Hkv, group, D]
    if token_weights is not None:
        width = min(num_blocks * bs, token_weights.shape[2])
        token_weights.zero_()
        # masked_fill: a seq_len of 0 gives NaN probabilities, but its weights are still all 0
        token_weights[:, :, :width] = probs.sum(dim=2).masked_fill(pad[:, None, :], 0.0)[:, :, :width]
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
    token_weights: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
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
        token_weights: optional float32 ``[N, Hkv, W]`` output, ``W >= max(seq_lens)``, on q's device.
            Overwritten with the column sums of each sequence's causal softmax: ``token_weights[i, g, j]``
            is the attention weight all of sequence ``i``'s queries in this step, over KV head ``g``'s
            query heads, give key ``j``; each ``[i, g]`` row sums to ``num_queries * Hq / Hkv``.
            ``j >= seq_lens[i]`` (and a sequence with no queries) is 0.
        window: sliding window in tokens (>= 1): the query at position ``p`` sees ``p - window + 1 .. p``;
            None = full causal. Blocks wholly before the first query's window are not read.
        sinks: float32 ``[Hq]`` attention-sink logits on q's device (unscaled), or None (module doc).

    Returns:
        ``[T_total, Hq, D]`` in ``q.dtype``; the same whether or not ``token_weights`` is given.

    Raises:
        ValueError: ``token_weights`` has the wrong dtype, shape, width or device; ``window`` or ``sinks``
            do not fit; ``token_weights`` together with ``window`` or ``sinks``.
    """
    check_window_and_sinks(window, sinks, num_q_heads=q.shape[1], device=q.device, token_weights=token_weights)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    hkv, block_size = k_cache.shape[1], k_cache.shape[2]
    if token_weights is not None:
        check_token_weights(token_weights, num_seqs=len(lens), num_kv_heads=hkv,
                            min_width=max(lens, default=0), device=q.device)
        token_weights.zero_()
    for i, seq_len in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        ctx_len = seq_len - (b - a)
        first_block = 0 if window is None else max(0, ctx_len - window + 1) // block_size
        k = gather_kv(k_cache, block_tables[i], seq_len, first_block=first_block)
        v = gather_kv(v_cache, block_tables[i], seq_len, first_block=first_block)
        out[a:b], probs = _attend(q[a:b], k, v, scale, ctx_len, key_offset=first_block * block_size,
                                  window=window, sinks=sinks)  # probs [Hq, Tq, keys]
        if token_weights is not None:
            token_weights[i, :, :seq_len] = probs.sum(dim=1).reshape(hkv, -1, seq_len).sum(dim=1)
    return out


def block_key_summaries(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Quest's per-block key summary: the elementwise min and max of each listed block's keys.

    Args:
        kv_pool: the whole pool ``[num_blocks, L, 2, Hkv, B, D]`` (dim 2: 0 keys, 1 values), any float dtype.
        block_ids: ``[n]`` integer block ids (< num_blocks). Blocks are assumed full (all B rows are keys).

    Returns:
        float32 ``[n, L, Hkv, 2, D]``: ``[..., 0, :]`` the min and ``[..., 1, :]`` the max over the
        block's B key rows, per layer and KV head. Nothing is mutated.
    """
    keys = kv_pool[block_ids.long(), :, 0].float()  # [n, L, Hkv, B, D]
    return torch.stack((keys.amin(dim=3), keys.amax(dim=3)), dim=3)


def score_blocks(q: torch.Tensor, summaries: torch.Tensor, cand_rows: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Quest's upper bound on a block's attention logits, summed over each KV group's query heads.

    ::

        score[c, g] = scale * sum_{h in group g} sum_d max(q[r, h, d] * min[c, g, d], q[r, h, d] * max[c, g, d])
        r = cand_rows[c];  group g = query heads g*G .. g*G + G-1,  G = Hq / Hkv

    For every key k in block c, ``scale * q[r, h] · k[g] <= scale * sum_d max(...)``, so the score bounds
    the sum over the group's heads of each head's largest logit in the block.

    Args:
        q: ``[N, Hq, D]`` float, one layer's decode queries (one per sequence).
        summaries: float32 ``[C, Hkv, 2, D]``, one layer's slice of `block_key_summaries` for the candidates.
        cand_rows: ``[C]`` integer, the q row each candidate block belongs to.
        scale: softmax scale.

    Returns:
        float32 ``[C, Hkv]`` (``[0, Hkv]`` when C is 0).
    """
    c, hkv = summaries.shape[0], summaries.shape[1]
    qf = q.float()[cand_rows.long()].reshape(c, hkv, q.shape[1] // hkv, q.shape[2])  # [C, Hkv, G, D]
    lo, hi = summaries[:, :, None, 0], summaries[:, :, None, 1]  # [C, Hkv, 1, D]
    return torch.maximum(qf * lo, qf * hi).sum(dim=(2, 3)) * scale


def paged_mla_decode(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed multi-head latent attention for one query token per sequence (DeepSeek decode).

    Every query head attends over the sequence's cached latent rows ``[c | k_rope]``: its logit for token j is
    ``scale · q_h · row_j`` (``q_h = [q_nope_h · W_UK_h | q_rope_h]``, absorbed by the caller), and its output
    is ``sum_j softmax_j · c_j``, the first ``kv_lora_rank`` columns of the rows (the caller multiplies it by
    ``W_UV``). The same as `paged_decode_attention` with one KV head whose values are the rows' latents.

    Args:
        q: ``[N, Hq, W]``, ``W = kv_lora_rank + rope width``.
        latent_cache: ``[num_blocks, B, W]`` (any strides, last dim contiguous): one layer's plane of the pool.
        block_tables: ``[N, max_blocks]`` integer; seq_lens: ``[N]`` integer, each >= 1.
        kv_lora_rank: the latent's width (< W).

    Returns:
        ``[N, Hq, kv_lora_rank]`` in ``q.dtype``; float32 math.
    """
    n, num_heads, width = q.shape
    out = torch.empty((n, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    block_size = latent_cache.shape[1]
    for i in range(n):
        length = int(seq_lens[i])
        blocks = block_tables[i, : (length + block_size - 1) // block_size].long()
        rows = latent_cache[blocks].reshape(-1, width)[:length].float()  # [L, W]
        probs = torch.softmax((q[i].float() @ rows.T) * scale, dim=-1)  # [Hq, L]
        out[i] = (probs @ rows[:, :kv_lora_rank]).to(q.dtype)
    return out


def mla_unabsorbed_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Multi-head latent attention computed as transformers does, the oracle of the absorbed path: each
    sequence's cached latents are expanded to per-head keys and values, ``[k_nope | v] = c · kv_b_weightᵀ``,
    the shared ``k_rope`` is appended to every head's key, and the queries attend causally.

    Args:
        q_nope: ``[T, H, nope]``; q_rope: ``[T, H, rope]`` (rotated). Tokens laid out by ``query_start_loc``.
        latent_cache: ``[num_blocks, B, kv_lora_rank + rope]``; the tokens' own rows already written.
        kv_b_weight: ``[H · (nope + v_head_dim), kv_lora_rank]`` (``kv_b_proj.weight``).
        block_tables: ``[N, M]``; seq_lens: ``[N]`` each sequence's length after this step;
        query_start_loc: ``[N + 1]`` cumulative query counts (a decode sequence has one query).

    Returns:
        ``[T, H, v_head_dim]`` in ``q_nope.dtype``; float32 math.
    """
    t, heads, nope = q_nope.shape
    rank = kv_b_weight.shape[1]
    block_size = latent_cache.shape[1]
    out = torch.empty((t, heads, v_head_dim), dtype=q_nope.dtype, device=q_nope.device)
    w = kv_b_weight.float().view(heads, nope + v_head_dim, rank)
    for i in range(block_tables.shape[0]):
        start, end, length = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        if end == start:
            continue
        blocks = block_tables[i, : (length + block_size - 1) // block_size].long()
        rows = latent_cache[blocks].reshape(-1, latent_cache.shape[-1])[:length].float()  # [L, W]
        kv = torch.einsum("lr,hcr->hlc", rows[:, :rank], w)  # [H, L, nope + v]
        keys = torch.cat([kv[..., :nope], rows[None, :, rank:].expand(heads, -1, -1)], dim=-1)
        values = kv[..., nope:]
        q = torch.cat([q_nope[start:end], q_rope[start:end]], dim=-1).float().transpose(0, 1)  # [H, n, nope+rope]
        scores = (q @ keys.transpose(1, 2)) * scale  # [H, n, L]
        pos = torch.arange(length - (end - start), length, device=q.device)
        scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out[start:end] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1).to(out.dtype)
    return out
