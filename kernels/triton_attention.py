"""Triton kernels for the decode path: KV write into blocks and split-K paged decode attention
(optionally also each cached token's attention weight, for H2O-style eviction).

Contracts are those of `kernels.reference` (same signatures, same results up to float rounding);
the launchers check shapes, strides, dtypes and devices before launching and raise ValueError naming
the problem. Cache layout, a view of one layer of the pool (see `kvstore.block_spec`)::

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size_tokens, head_dim]   (any strides, last dim 1)
    slot = block_id * block_size_tokens + offset

Works on CUDA tensors, or on CPU tensors when Triton runs with ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels import reference
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
TORCH_TO_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Split-K: one split per this many tokens of block-table capacity, at most MAX_SPLITS.
TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32
# Tokens loaded per loop iteration; may span several blocks (each token finds its own block).
MIN_TILE_TOKENS = 64
# tl.dot needs every dimension >= 16.
MIN_DOT_DIM = 16
# Positions per program of the token-weight kernel.
WEIGHTS_TILE_TOKENS = 128
LOG2E = 1.4426950408889634


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_tensor(name: str, t: torch.Tensor, *, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """Rank, dtype and a contiguous last dim (the kernels take every other stride as given)."""
    _require(t.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    _require(t.dtype in dtypes, f"{name}.dtype is {t.dtype}; use one of {list(dtypes)}")
    _require(t.shape[-1] <= 1 or t.stride(-1) == 1,
             f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    _require(all(d == first for d in devices.values()), f"tensors are on different devices: {devices}")
    interpreted = isinstance(_decode_split_kernel, InterpretedFunction)
    _require(first.type == "cuda" or interpreted,
             f"Triton kernels need CUDA tensors (got {first}); on CPU use the reference backend "
             "or run Triton with TRITON_INTERPRET=1")
    return first


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    _check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    _require(k_cache.shape == v_cache.shape,
             f"k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")
    _require(k_cache.dtype == v_cache.dtype, f"k_cache.dtype {k_cache.dtype} != v_cache.dtype {v_cache.dtype}")


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its slot. Mutates ``k_cache`` and ``v_cache``.

    Args:
        k_cache, v_cache: ``[num_blocks, H, B, D]``, float32/bfloat16/float16, last dim contiguous.
        key, value: ``[T, H, D]`` float, last dim contiguous; cast to the cache dtype (round to nearest even).
        slot_mapping: ``[T]`` int32/int64 slots; a negative slot skips that token (padding).
            Slots must be < ``num_blocks * B``; that is not checked (it would need a device sync).

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, naming which.
    """
    _check_caches(k_cache, v_cache)
    _check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    _check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES)
    _require(slot_mapping.dim() == 1 and slot_mapping.dtype in INDEX_DTYPES,
             f"slot_mapping must be 1-D int32/int64, got shape {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    num_tokens = key.shape[0]
    _, num_heads, block_size, head_dim = k_cache.shape
    _require(key.shape == (num_tokens, num_heads, head_dim),
             f"key shape {tuple(key.shape)} does not fit the cache; expected [T, {num_heads}, {head_dim}]")
    _require(value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _require(slot_mapping.shape[0] == num_tokens,
             f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    _check_same_device(k_cache=k_cache, v_cache=v_cache, key=key, value=value, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, key, value, slot_mapping,
        *k_cache.stride()[:3], *v_cache.stride()[:3], *key.stride()[:2], *value.stride()[:2],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _write_kv_kernel(
    k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, key_ptr: tl.tensor, value_ptr: tl.tensor, slot_ptr: tl.tensor,
    stride_kc_block: tl.tensor, stride_kc_head: tl.tensor, stride_kc_row: tl.tensor,
    stride_vc_block: tl.tensor, stride_vc_head: tl.tensor, stride_vc_row: tl.tensor,
    stride_k_tok: tl.tensor, stride_k_head: tl.tensor, stride_v_tok: tl.tensor, stride_v_head: tl.tensor,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """One program per token: copies its ``[H, D]`` key and value tiles into its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM) & (slot >= 0)
    k = tl.load(key_ptr + token.to(tl.int64) * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + heads * stride_kc_head + row * stride_kc_row + dims
    v_dst = v_cache_ptr + block * stride_vc_block + heads * stride_vc_head + row * stride_vc_row + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def decode_num_splits(max_tokens: int) -> int:
    """Splits per (sequence, KV head): one per `TOKENS_PER_SPLIT` tokens, 1 to `MAX_SPLITS`.

    ``max_tokens`` is the block-table capacity (``max_blocks * B``), known on the host without a
    device sync, so the launch shape depends only on tensor shapes (deterministic, graph-capturable).
    """
    return max(1, min(MAX_SPLITS, triton.cdiv(max_tokens, TOKENS_PER_SPLIT)))


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
    """One query token per sequence attending over that sequence's cached tokens (flash-decoding).

    Each sequence's visible tokens ``[lo, seq_len)`` (``lo = max(0, seq_len - window)``, 0 without a
    window) are cut into `decode_num_splits` splits of whole tiles (``ceil((seq_len - lo) / S)`` rounded up
    to the tile), so a short sequence in a wide table — a CUDA graph's tables are as wide as the model's
    context — still spreads over every split, and nothing before ``lo`` is read::

        tokens:  [ lo: split 0 ...... | split 1 ...... | ... | split S-1 ]   (splits past seq_len are empty)
        stage 1: grid (N, Hkv, S); one program = all Hq/Hkv query heads of one KV head over one split,
                 online softmax in float32 -> partial (max, sum, acc) in a float32 scratch buffer
        stage 2: grid (N, Hq); rescales and sums the S partials -> out; a head's sink (base 2:
                 ``sink * log2(e)``) joins here once, as one more partial with sum 1 and acc 0

    With ``token_weights``, stage 1 also stores every scaled logit (base 2) to a float32 scratch
    ``[N, Hq, max_blocks * B]``, stage 2 stores each head's log-sum-exp (base 2), and a stage 3
    (grid ``(N, Hkv, cdiv(W, WEIGHTS_TILE_TOKENS))``) writes ``sum over the group of exp2(logit - lse)``,
    0 from seq_len to W. The scratch costs ``4 * N * Hq * max_blocks * B`` bytes for the step.

    Args:
        q: ``[N, Hq, D]`` float, last dim contiguous; ``Hq`` a multiple of ``Hkv``.
        k_cache, v_cache: ``[num_blocks, Hkv, B, D]`` float (any strides, last dim contiguous).
        block_tables: ``[N, max_blocks]`` int32/int64 (int64 is converted); entries past a
            sequence's length are never read.
        seq_lens: ``[N]`` int32/int64, tokens to attend over (>= 1); a 0 gives a zero output row.
            Each must be <= ``max_blocks * B``; that is not checked (it would need a device sync).
        scale: softmax scale, usually ``D ** -0.5``.
        token_weights: optional float32 ``[N, Hkv, W]`` output (last dim contiguous), ``W >= max(seq_lens)``,
            overwritten as in `kernels.reference.paged_decode_attention`. Checking the width needs a
            device sync only when ``W < max_blocks * B``; allocate at least that to avoid it.
        window: sliding window in tokens (>= 1, a plain int kernel argument) or None; table entries of
            blocks wholly before the window are never read.
        sinks: float32 ``[Hq]`` attention-sink logits (unscaled) on q's device, or None.

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``, newly allocated; the same whether or not ``token_weights`` is
        given. Nothing else is mutated.

    Raises:
        ValueError: a shape, dtype, stride or device does not fit, naming which; ``token_weights``
            together with ``window`` or ``sinks``.
    """
    _check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _check_caches(k_cache, v_cache)
    _require(block_tables.dim() == 2 and block_tables.dtype in INDEX_DTYPES,
             f"block_tables must be 2-D int32/int64, got shape {tuple(block_tables.shape)} {block_tables.dtype}")
    _require(seq_lens.dim() == 1 and seq_lens.dtype in INDEX_DTYPES,
             f"seq_lens must be 1-D int32/int64, got shape {tuple(seq_lens.shape)} {seq_lens.dtype}")
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    _require(head_dim == cache_head_dim, f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    _require(num_q_heads % num_kv_heads == 0,
             f"q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    _require(block_tables.shape[0] == num_seqs and seq_lens.shape[0] == num_seqs,
             f"block_tables rows {block_tables.shape[0]} and seq_lens {seq_lens.shape[0]} "
             f"must equal q's {num_seqs} sequences")
    device = _check_same_device(q=q, k_cache=k_cache, v_cache=v_cache,
                                block_tables=block_tables, seq_lens=seq_lens)
    reference.check_window_and_sinks(window, sinks, num_q_heads=num_q_heads, device=device,
                                     token_weights=token_weights)
    max_tokens = max(1, block_tables.shape[1] * block_size)
    if token_weights is not None:
        _check_token_weights(token_weights, seq_lens, num_kv_heads=num_kv_heads, max_tokens=max_tokens,
                             device=device)
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0:
        return out
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()

    group = num_q_heads // num_kv_heads
    tile_tokens = max(MIN_TILE_TOKENS, triton.next_power_of_2(block_size))
    num_splits = decode_num_splits(max_tokens)
    # The interpreter multiplies bf16 as raw integers in tl.dot, and mixed dtypes need float32 anyway.
    interpreted = isinstance(_decode_split_kernel, InterpretedFunction)
    same_dtype = q.dtype == k_cache.dtype
    dot_dtype = tl.float32 if interpreted or not same_dtype else TORCH_TO_TL_DTYPE[q.dtype]

    part_max = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    want_weights = token_weights is not None
    # Without weights the two buffers are never touched; part_max stands in for their pointers.
    logits = (torch.empty((num_seqs, num_q_heads, max_tokens), dtype=torch.float32, device=device)
              if want_weights else part_max)
    lse = torch.empty((num_seqs, num_q_heads), dtype=torch.float32, device=device) if want_weights else part_max
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_max, part_sum, part_acc, logits,
        scale * LOG2E, block_tables.shape[1], max_tokens, 0 if window is None else window,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(MIN_DOT_DIM, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=max(MIN_DOT_DIM, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE=tile_tokens, DOT_DTYPE=dot_dtype, STORE_LOGITS=want_weights,
        HAS_WINDOW=window is not None,
    )
    _reduce_splits_kernel[(num_seqs, num_q_heads)](
        part_max, part_sum, part_acc, out, lse, part_max if sinks is None else sinks, *out.stride()[:2],
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), STORE_LSE=want_weights,
        HAS_SINKS=sinks is not None,
    )
    if want_weights:
        width = token_weights.shape[2]
        _token_weights_kernel[(num_seqs, num_kv_heads, triton.cdiv(width, WEIGHTS_TILE_TOKENS))](
            logits, lse, seq_lens, token_weights, max_tokens, width, *token_weights.stride()[:2],
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), TILE=WEIGHTS_TILE_TOKENS,
        )
    return out


def _check_token_weights(token_weights: torch.Tensor, seq_lens: torch.Tensor, *, num_kv_heads: int,
                         max_tokens: int, device: torch.device) -> None:
    """float32 ``[N, Hkv, W]`` on ``device``, last dim contiguous, ``W >= max(seq_lens)``."""
    _check_tensor("token_weights", token_weights, ndim=3, dtypes=(torch.float32,))
    # max(seq_lens) needs a device sync; skip it when W covers the block-table capacity, which bounds every seq_len.
    narrow = token_weights.shape[2] < max_tokens and seq_lens.shape[0] > 0
    reference.check_token_weights(token_weights, num_seqs=seq_lens.shape[0], num_kv_heads=num_kv_heads,
                                  min_width=int(seq_lens.max()) if narrow else 0, device=device)


@triton.jit
def _load_kv_tile(
    k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, block_table: tl.tensor, max_blocks: tl.tensor,
    tile_start: tl.tensor, end: tl.tensor, kv_head: tl.tensor, d: tl.tensor,
    stride_kc_block: tl.tensor, stride_kc_head: tl.tensor, stride_kc_row: tl.tensor,
    stride_vc_block: tl.tensor, stride_vc_head: tl.tensor, stride_vc_row: tl.tensor,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Positions ``t = tile_start + [0, TILE)`` of one sequence (``block_table``: its row of the block table),
    their validity ``t < end``, and their K and V rows of ``kv_head`` (``[TILE, DIM_PAD]`` in ``DOT_DTYPE``,
    0 where invalid). Each position finds its own block, so a tile may span several blocks."""
    t = tile_start + tl.arange(0, TILE)
    t_valid = t < end
    block_idx = t // BLOCK_SIZE
    block = tl.load(block_table + block_idx, mask=t_valid & (block_idx < max_blocks), other=0).to(tl.int64)
    row = t % BLOCK_SIZE
    kv_mask = t_valid[:, None] & (d[None, :] < HEAD_DIM)
    k_ptrs = (k_cache_ptr + block[:, None] * stride_kc_block + kv_head * stride_kc_head
              + row[:, None] * stride_kc_row + d[None, :])
    v_ptrs = (v_cache_ptr + block[:, None] * stride_vc_block + kv_head * stride_vc_head
              + row[:, None] * stride_vc_row + d[None, :])
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    return t, t_valid, k, v


@triton.jit
def _decode_split_kernel(
    q_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor,
    block_tables_ptr: tl.tensor, seq_lens_ptr: tl.tensor,
    part_max_ptr: tl.tensor, part_sum_ptr: tl.tensor, part_acc_ptr: tl.tensor, logits_ptr: tl.tensor,
    qk_scale_log2: tl.tensor, max_blocks: tl.tensor, max_tokens: tl.tensor, window: tl.tensor,
    stride_q_seq: tl.tensor, stride_q_head: tl.tensor,
    stride_kc_block: tl.tensor, stride_kc_head: tl.tensor, stride_kc_row: tl.tensor,
    stride_vc_block: tl.tensor, stride_vc_head: tl.tensor, stride_vc_row: tl.tensor,
    stride_bt_seq: tl.tensor,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_DTYPE: tl.constexpr, STORE_LOGITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Stage 1: partial softmax of one (sequence, KV head, split). Scores are kept in base 2.

    With ``HAS_WINDOW`` the splits cover positions ``[seq_len - window, seq_len)`` only (from 0 if shorter).
    With ``STORE_LOGITS`` each valid score also goes to ``logits[seq, q_head, t]`` (``[N, Hq, max_tokens]``).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # the first visible position
    else:
        lo = 0
    # Tiles may start off a block edge (each position finds its own block); from the length: no host read.
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), TILE) * TILE
    start = lo + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    q_heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_seq + q_heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in tl.range(start, end, TILE):
        t, t_valid, k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table, max_blocks, tile_start, end, kv_head, d,
            stride_kc_block, stride_kc_head, stride_kc_row, stride_vc_block, stride_vc_head, stride_vc_row,
            HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE, DOT_DTYPE=DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2  # [GROUP_PAD, TILE]
        if STORE_LOGITS:
            logit_rows = (seq * tl.num_programs(1) * GROUP + q_heads).to(tl.int64) * max_tokens
            tl.store(logits_ptr + logit_rows[:, None] + t[None, :], s,
                     mask=(g[:, None] < GROUP) & t_valid[None, :])
        s = tl.where(t_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    # Scratch layout [N, Hq, S] and [N, Hq, S, D]; an empty split leaves (-inf, 0, 0).
    part = (seq * tl.num_programs(1) * GROUP + q_heads).to(tl.int64) * num_splits + split
    g_valid = g < GROUP
    tl.store(part_max_ptr + part, m_i, mask=g_valid)
    tl.store(part_sum_ptr + part, l_i, mask=g_valid)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)


@triton.jit
def _reduce_splits_kernel(
    part_max_ptr: tl.tensor, part_sum_ptr: tl.tensor, part_acc_ptr: tl.tensor, out_ptr: tl.tensor,
    lse_ptr: tl.tensor, sinks_ptr: tl.tensor, stride_out_seq: tl.tensor, stride_out_head: tl.tensor,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Stage 2: combine one (sequence, query head)'s split partials into its output row.

    With ``HAS_SINKS`` the head's sink ``sinks[head]`` (natural units) is one more logit: it enters the max
    and adds ``exp2(sink * log2(e) - max)`` to the sum, nothing to the output.
    With ``STORE_LSE`` also stores the head's base-2 log-sum-exp to ``lse[seq, head]`` (``[N, Hq]``).
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS + sp
    sp_valid = sp < NUM_SPLITS
    m = tl.load(part_max_ptr + part, mask=sp_valid, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=sp_valid, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                  mask=sp_valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # base 2, as the scores
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # seq_len 0: all splits empty
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l_s, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_max)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + d
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    if STORE_LSE:
        tl.store(lse_ptr + seq.to(tl.int64) * tl.num_programs(1) + head, m_max + tl.log2(total))


@triton.jit
def _token_weights_kernel(
    logits_ptr: tl.tensor, lse_ptr: tl.tensor, seq_lens_ptr: tl.tensor, weights_ptr: tl.tensor,
    max_tokens: tl.tensor, width: tl.tensor, stride_w_seq: tl.tensor, stride_w_head: tl.tensor,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE: tl.constexpr,
):
    """Stage 3: ``weights[seq, kv_head, t] = sum over the group of exp2(logit - lse)`` for t < seq_len,
    0 for seq_len <= t < width; one program per (sequence, KV head, tile of TILE positions)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    t = tl.program_id(2) * TILE + tl.arange(0, TILE)
    g = tl.arange(0, GROUP_PAD)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_heads = (seq * tl.num_programs(1) * GROUP + kv_head * GROUP + g).to(tl.int64)
    g_valid = g < GROUP
    lse = tl.load(lse_ptr + q_heads, mask=g_valid, other=0.0)
    valid = g_valid[:, None] & (t < seq_len)[None, :]
    s = tl.load(logits_ptr + q_heads[:, None] * max_tokens + t[None, :], mask=valid, other=float("-inf"))
    w = tl.sum(tl.where(valid, tl.exp2(s - lse[:, None]), 0.0), axis=0)
    w_ptrs = weights_ptr + seq.to(tl.int64) * stride_w_seq + kv_head * stride_w_head + t
    tl.store(w_ptrs, w, mask=t < width)
