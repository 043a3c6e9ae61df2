"""One Triton paged attention launch for a whole model step: prefill chunks (with or without a cached
prefix) and decode tokens together, with the contract of `kernels.reference.prefill_attention`.

A decode sequence is one with a single query; a sequence with none gets no work. Cache layout, a view
of one layer of the pool (see `kvstore.block_spec`)::

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size_tokens, head_dim]   (any strides, last dim 1)

Programs and tiles. Queries are cut into tiles of ``BLOCK_Q`` positions per sequence; one program is
one (query tile, KV head) and covers all ``G = Hq / Hkv`` query heads of that KV head, so each K/V tile
it loads serves ``BLOCK_Q * G`` score rows::

    sequence i:  [ cached prefix ............ | q tile 0 | q tile 1 | .. ]     tiles of BLOCK_Q queries
                  0                   ctx_len                     seq_len
    rows of one program:  (query 0, head 0..G_PAD-1), (query 1, head 0..G_PAD-1), ...   BLOCK_Q * G_PAD rows
    its KV loop:          [ tile | tile | ... | tile ]   KV_TILE_TOKENS each, up to the causal limit of
                                                         the program's last query; a tile may span blocks

``G_PAD`` is ``G`` rounded up to a power of two and ``BLOCK_Q = max(1, QUERY_ROWS // G_PAD)``; padded
heads, padded head dims and queries past a sequence's count are masked. Scores stay in base 2 and the
softmax is online (flash-attention), so a program holds one ``[rows, KV_TILE_TOKENS]`` score tile at a
time, whatever the sequence lengths.

The query tiles of all sequences are numbered in one flat grid axis, so the launch shape depends only on
tensor shapes (no device sync, graph-capturable)::

    first tile of sequence i = query_start_loc[i] // BLOCK_Q + i        (a binary search finds i)
    grid = (T_total // BLOCK_Q + N, Hkv)                                 (spare tiles do nothing)

Sliding window (``window`` W, a plain int argument): a program's KV loop starts at the first query's first
visible position, ``max(0, ctx_len + tile_q0 - W + 1)`` (tiles may start off a block edge), and rows mask
keys at or before ``position - W``; nothing before that start is read. Sinks (a pointer, ``HAS_SINKS``):
each row's online softmax starts at ``(m, l, acc) = (sink * log2(e), 1, 0)`` instead of ``(-inf, 0, 0)``.

With ``token_weights`` the attention pass also stores each (query token, query head)'s base-2
log-sum-exp, ``[T_total, Hq]`` float32, and a second kernel with one program per (sequence, KV head,
tile of `WEIGHTS_KEY_TILE_TOKENS` key positions) recomputes the scores of every query that can see the
tile and sums ``exp2(score - lse)`` over queries and the group's heads. No atomics, O(tokens) scratch.

Works on CUDA tensors, or on CPU tensors when Triton runs with ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels import reference
from kvrelay.kernels.triton_attention import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LOG2E,
    MIN_DOT_DIM,
    TORCH_TO_TL_DTYPE,
    _check_caches,
    _check_same_device,
    _check_tensor,
    _check_token_weights,
    _load_kv_tile,
    _require,
)
from triton.runtime.interpreter import InterpretedFunction

# Score rows per program (query positions x padded group); trades wasted rows on decode tokens against
# K/V reuse on prefill chunks. At least 16 (tl.dot), a power of two.
QUERY_ROWS = 64
# Keys loaded per KV loop iteration of the attention kernel; may span several blocks.
KV_TILE_TOKENS = 64
# Key positions per program of the token-weight kernel.
WEIGHTS_KEY_TILE_TOKENS = 64


def query_tile_shape(num_q_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """``(BLOCK_Q, G_PAD)``: query positions per program and the padded group; their product is >= 16."""
    group_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    block_q = max(1, QUERY_ROWS // group_pad, MIN_DOT_DIM // group_pad)
    return block_q, group_pad


def unified_attention(
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
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves.

    ::

        sequence i:  [ cached prefix .......... | new tokens (queries) ]
                      0                 ctx_len                 seq_lens[i]
        queries: q[query_start_loc[i] : query_start_loc[i+1]], ctx_len = seq_lens[i] - num_queries

    The new tokens' KV must already be written into the cache. A decode token is a sequence with one query.

    Args:
        q: ``[T_total, Hq, D]`` float32/bfloat16/float16 (any strides, last dim contiguous); ``Hq`` a
            multiple of ``Hkv``.
        k_cache, v_cache: ``[num_blocks, Hkv, B, D]`` float (any strides, last dim contiguous).
        block_tables: ``[N, max_blocks]`` int32/int64 (converted to int32); entries past a sequence's
            length are never read.
        seq_lens: ``[N]`` int32/int64, tokens of each sequence after this step (>= its query count, and
            <= ``max_blocks * B``; not checked: it would need a device sync).
        query_start_loc: ``[N + 1]`` int32/int64, cumulative query counts starting at 0, ending at most at
            ``T_total``; a sequence may have 0 queries. Rows of ``q`` past ``query_start_loc[N]`` get no
            output (their rows of the result are uninitialized, as in the reference).
        scale: softmax scale, usually ``D ** -0.5``.
        token_weights: optional float32 ``[N, Hkv, W]`` output (last dim contiguous), ``W >= max(seq_lens)``,
            overwritten as in `kernels.reference.prefill_attention` (column sums of each sequence's causal
            softmax over KV head ``g``'s query heads; 0 past ``seq_lens[i]`` and for a sequence with no
            queries). Checking the width needs a device sync only when ``W < max_blocks * B``.
        window: sliding window in tokens (>= 1): the query at position ``p`` sees ``p - window + 1 .. p``;
            None = full causal. Table entries of blocks wholly before a sequence's first query's window are
            never read.
        sinks: float32 ``[Hq]`` attention-sink logits (unscaled) on q's device, or None.

    Returns:
        ``[T_total, Hq, D]`` in ``q.dtype``, newly allocated; the same whether or not ``token_weights`` is
        given. Nothing else is mutated.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, naming which; ``token_weights``
            together with ``window`` or ``sinks``.
    """
    _check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _check_caches(k_cache, v_cache)
    for name, t, ndim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                          ("query_start_loc", query_start_loc, 1)):
        _require(t.dim() == ndim and t.dtype in INDEX_DTYPES,
                 f"{name} must be {ndim}-D int32/int64, got shape {tuple(t.shape)} {t.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _require(head_dim == cache_head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    _require(num_q_heads % num_kv_heads == 0,
             f"q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    _require(block_tables.shape[0] == num_seqs,
             f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences (seq_lens)")
    _require(query_start_loc.shape[0] == num_seqs + 1,
             f"query_start_loc has {query_start_loc.shape[0]} entries; expected N + 1 = {num_seqs + 1}")
    device = _check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                                seq_lens=seq_lens, query_start_loc=query_start_loc)
    reference.check_window_and_sinks(window, sinks, num_q_heads=num_q_heads, device=device,
                                     token_weights=token_weights)
    max_tokens = max(1, block_tables.shape[1] * block_size)
    if token_weights is not None:
        _check_token_weights(token_weights, seq_lens, num_kv_heads=num_kv_heads, max_tokens=max_tokens,
                             device=device)
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0 or num_tokens == 0:
        if token_weights is not None:
            token_weights.zero_()
        return out
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()

    group = num_q_heads // num_kv_heads
    block_q, group_pad = query_tile_shape(num_q_heads, num_kv_heads)
    dim_pad = max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    # The interpreter multiplies bf16 as raw integers in tl.dot, and mixed dtypes need float32 anyway.
    interpreted = isinstance(_unified_attention_kernel, InterpretedFunction)
    dot_dtype = tl.float32 if interpreted or q.dtype != k_cache.dtype else TORCH_TO_TL_DTYPE[q.dtype]
    want_weights = token_weights is not None
    # Without weights the log-sum-exp is never stored; out stands in for its pointer.
    lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=device) if want_weights else out
    qk_scale_log2 = scale * LOG2E
    common = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
                  BLOCK_SIZE=block_size, DOT_DTYPE=dot_dtype)
    _unified_attention_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, lse, out if sinks is None else sinks,
        qk_scale_log2, num_seqs, block_tables.shape[1], 0 if window is None else window,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        *out.stride()[:2],
        TILE=KV_TILE_TOKENS, STORE_LSE=want_weights, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        **common,
    )
    width = token_weights.shape[2] if want_weights else 0
    if width > 0:
        _unified_token_weights_kernel[(num_seqs, num_kv_heads, triton.cdiv(width, WEIGHTS_KEY_TILE_TOKENS))](
            q, k_cache, block_tables, seq_lens, query_start_loc, lse, token_weights,
            qk_scale_log2, block_tables.shape[1], width,
            *q.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0), *token_weights.stride()[:2],
            TILE=WEIGHTS_KEY_TILE_TOKENS, **common,
        )
    return out


@triton.jit
def _find_sequence(query_start_loc_ptr: tl.tensor, q_tile: tl.tensor, num_seqs: tl.tensor, BLOCK_Q: tl.constexpr):
    """The last sequence ``i`` whose first query tile ``query_start_loc[i] // BLOCK_Q + i`` is <= ``q_tile``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= q_tile, mid + 1, lo)
        hi = tl.where(first_tile <= q_tile, hi, mid)
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, block_tables_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor, query_start_loc_ptr: tl.tensor, out_ptr: tl.tensor, lse_ptr: tl.tensor,
    sinks_ptr: tl.tensor, qk_scale_log2: tl.tensor, num_seqs: tl.tensor, max_blocks: tl.tensor, window: tl.tensor,
    stride_q_tok: tl.tensor, stride_q_head: tl.tensor,
    stride_kc_block: tl.tensor, stride_kc_head: tl.tensor, stride_kc_row: tl.tensor,
    stride_vc_block: tl.tensor, stride_vc_head: tl.tensor, stride_vc_row: tl.tensor,
    stride_bt_seq: tl.tensor, stride_out_tok: tl.tensor, stride_out_head: tl.tensor,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, TILE: tl.constexpr,
    STORE_LSE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One (query tile, KV head): online causal softmax over the sequence's KV tiles, scores in base 2.

    ``HAS_WINDOW``: keys from the tile's first query's window on, each row masking those at or before its
    ``position - window``. ``HAS_SINKS``: rows start from their head's sink ``sinks[q_head]`` (natural units).
    With ``STORE_LSE`` also stores each valid row's base-2 log-sum-exp to ``lse[token, q_head]``
    (``[T_total, Hq]``).
    """
    flat_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, flat_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - num_queries
    tile_q0 = (flat_tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile in the sequence
    # Keys up to the causal limit of the tile's last query; none for a tile past the sequence's queries.
    kv_end = tl.where(tile_q0 < num_queries, tl.minimum(ctx_len + tile_q0 + BLOCK_Q, seq_len), 0)

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = tile_q0 + r // GROUP_PAD
    g = r % GROUP_PAD
    pos = ctx_len + qi
    row_valid = (qi < num_queries) & (g < GROUP)
    d = tl.arange(0, DIM_PAD)
    q_heads = kv_head * GROUP + g
    rd_mask = row_valid[:, None] & (d[None, :] < HEAD_DIM)
    tokens = (q_start + qi).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_q_tok + q_heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=rd_mask, other=0.0).to(DOT_DTYPE)

    if HAS_SINKS:  # the sink as a first "key" already seen: m = its logit (base 2), l = exp2(0), acc = 0
        m_i = tl.load(sinks_ptr + q_heads, mask=g < GROUP, other=float("-inf")) * 1.4426950408889634
        l_i = tl.where(g < GROUP, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    if HAS_WINDOW:
        kv_start = tl.maximum(ctx_len + tile_q0 - window + 1, 0)  # the first query's first visible key
    else:
        kv_start = 0
    for tile_start in tl.range(kv_start, kv_end, TILE):
        t, t_valid, k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, max_blocks, tile_start, kv_end, kv_head, d,
            stride_kc_block, stride_kc_head, stride_kc_row, stride_vc_block, stride_vc_head, stride_vc_row,
            HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, DOT_DTYPE=DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2  # [rows, TILE]
        visible = (t[None, :] <= pos[:, None]) & t_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (t[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Without a window every row sees key 0 in the first tile (invalid rows sit past every key), so
        # m_i is finite after it and a later fully masked row only adds exp2(-inf) = 0. With one, a row
        # may have seen no key yet (a padding row past the window): it stays at (-inf, 0, 0), with 0
        # standing in for its max so that exp2(-inf - -inf) is never taken.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if HAS_WINDOW else m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # 0 only on invalid rows (no keys), whose stores are masked
    o = acc / l_safe[:, None]
    out_ptrs = out_ptr + tokens[:, None] * stride_out_tok + q_heads[:, None] * stride_out_head + d[None, :]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=rd_mask)
    if STORE_LSE:
        lse_rows = tokens * (tl.num_programs(1) * GROUP) + q_heads
        tl.store(lse_ptr + lse_rows, m_i + tl.log2(l_safe), mask=row_valid)


@triton.jit
def _unified_token_weights_kernel(
    q_ptr: tl.tensor, k_cache_ptr: tl.tensor, block_tables_ptr: tl.tensor, seq_lens_ptr: tl.tensor,
    query_start_loc_ptr: tl.tensor, lse_ptr: tl.tensor, weights_ptr: tl.tensor,
    qk_scale_log2: tl.tensor, max_blocks: tl.tensor, width: tl.tensor,
    stride_q_tok: tl.tensor, stride_q_head: tl.tensor,
    stride_kc_block: tl.tensor, stride_kc_head: tl.tensor, stride_kc_row: tl.tensor,
    stride_bt_seq: tl.tensor, stride_w_seq: tl.tensor, stride_w_head: tl.tensor,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, TILE: tl.constexpr,
):
    """One (sequence, KV head, tile of TILE key positions): ``weights[seq, kv_head, t]`` is the sum over the
    sequence's queries at positions >= t and the group's heads of ``exp2(score - lse)``; 0 from seq_len
    to ``width``. Query tiles that end before the key tile starts are skipped."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    key0 = tl.program_id(2) * TILE
    t = key0 + tl.arange(0, TILE)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = seq_len - num_queries
    # Query qi (position ctx_len + qi) sees key t iff qi >= t - ctx_len.
    q_lo = tl.maximum(key0 - ctx_len, 0) // BLOCK_Q * BLOCK_Q
    q_hi = tl.where(key0 < seq_len, num_queries, 0)

    d = tl.arange(0, DIM_PAD)
    t_valid = t < seq_len
    block_idx = t // BLOCK_SIZE
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    block = tl.load(block_table + block_idx, mask=t_valid & (block_idx < max_blocks), other=0).to(tl.int64)
    k_ptrs = (k_cache_ptr + block[:, None] * stride_kc_block + kv_head * stride_kc_head
              + (t % BLOCK_SIZE)[:, None] * stride_kc_row + d[None, :])
    k = tl.load(k_ptrs, mask=t_valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(DOT_DTYPE)

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    g = r % GROUP_PAD
    q_heads = kv_head * GROUP + g
    w = tl.zeros([TILE], tl.float32)
    for q0 in tl.range(q_lo, q_hi, BLOCK_Q):
        qi = q0 + r // GROUP_PAD
        row_valid = (qi < num_queries) & (g < GROUP)
        tokens = (q_start + qi).to(tl.int64)
        q_ptrs = q_ptr + tokens[:, None] * stride_q_tok + q_heads[:, None] * stride_q_head + d[None, :]
        q = tl.load(q_ptrs, mask=row_valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(DOT_DTYPE)
        lse = tl.load(lse_ptr + tokens * (tl.num_programs(1) * GROUP) + q_heads, mask=row_valid, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2  # [rows, TILE]
        keep = row_valid[:, None] & (t[None, :] <= (ctx_len + qi)[:, None])
        w += tl.sum(tl.where(keep, tl.exp2(s - lse[:, None]), 0.0), axis=0)
    w_ptrs = weights_ptr + seq.to(tl.int64) * stride_w_seq + kv_head * stride_w_head + t
    tl.store(w_ptrs, w, mask=t < width)
