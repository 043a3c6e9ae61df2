"""DeepSeek-V2/V3's parts of the decoder: multi-head latent attention (`MlaAttention`) and the mixture of
experts with shared experts and group-limited routing (`DeepseekMoe`). `model.llama.DecoderLayer` builds
them when `ModelConfig.mla` / a DeepSeek `ModelConfig.moe` says so; the rest of the decoder (embeddings,
norms, residuals, head) is shared. Parameter names are the checkpoints' (``self_attn.kv_a_proj_with_mqa``,
``mlp.shared_experts.gate_proj``, ``mlp.gate.e_score_correction_bias``)::

    x ─┬─ q_a_proj → q_a_layernorm → q_b_proj (or q_proj) → per head [q_nope | q_rope]
       └─ kv_a_proj_with_mqa → [c | k_rope];  c = kv_a_layernorm(c)

    cached per token and layer: one latent row [c | rope(k_rope)]  (kv_lora_rank + qk_rope_head_dim values)

    kv_b_proj.weight, per head h:  W_UK[h] [nope, rank] (keys) | W_UV[h] [v, rank] (values)

Decode attends in latent space, absorbed (as vLLM and FlashMLA decode): each head's query becomes
``q_h = [q_nope_h · W_UK[h] | rope(q_rope_h)]``, which scores a latent row exactly as the expanded key
``[W_UK[h] · c | k_rope]`` would; the heads attend over the rows as one KV head (`kernels.triton_mla` on Triton,
else the backend's decode kernel with the rows as keys and values), and the first ``rank`` columns of the output,
the weighted sum of latents, are multiplied by ``W_UV[h]``. Per step that reads each cached row once for all
heads instead of expanding every row to ``H`` keys and values.

Prefill expands instead, as transformers does: the sequence's cached and new latents become per-head keys
``[W_UK[h] · c | k_rope]`` and values ``W_UV[h] · c``, and the new tokens attend causally through fused SDPA.
Measured here (``kvrelay bench mla``, DeepSeek-V3's head shapes, 16 heads, float32, 2 CPUs) absorbed prefill
took 1.6–2.2× as long (its scores and outputs are ``rank + rope`` wide instead of 192 and 128), absorbed decode
0.03–0.13× as long as the per-sequence reference that expands every cached row each step.
`MlaAttention.absorbed_decode` / `absorbed_prefill` switch each (tests and the benchmark compare both ways;
`kernels.reference.mla_unabsorbed_attention` is the oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvrelay.kernels import reference
from kvrelay.model.attention import AttentionBackend, AttentionBatch
from kvrelay.model.config import ModelConfig, MoeConfig
from kvrelay.model.linear_kernel import LinearKernel
from kvrelay.model.moe import SparseMoe, experts_grouped
from kvrelay.model.rope import apply_rotary
from torch import nn


class MlaAttention(nn.Module):
    """Multi-head latent attention of one layer (see module doc); reads and writes its plane of the pool."""

    def __init__(self, config: ModelConfig, layer_idx: int, rms_norm: type[nn.Module]) -> None:
        """``rms_norm``: the decoder's RMSNorm class (`model.llama.RMSNorm`, which builds this layer)."""
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        self.layer_idx = layer_idx
        self.num_heads = heads = config.num_attention_heads
        hidden, qk_dim = config.hidden_size, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = rms_norm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_width, bias=config.qkv_bias)
        self.kv_a_layernorm = rms_norm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=config.o_bias)
        self.scale = mla.softmax_scale
        self.absorbed_decode = True  # see module doc
        self.absorbed_prefill = False
        self.w_uk: torch.Tensor | None = None  # [H, nope, rank], set by `prepare`
        self.w_uv_t: torch.Tensor | None = None  # [H, rank, v]
        self.out: LinearKernel | None = None

    def prepare(self) -> None:
        """Split ``kv_b_proj`` into the per-head absorption matrices, and pick o_proj's matmul kernel."""
        mla, heads = self.mla, self.num_heads
        w = self.kv_b_proj.weight.detach().view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.w_uk = w[:, : mla.qk_nope_head_dim].contiguous()
        self.w_uv_t = w[:, mla.qk_nope_head_dim :].transpose(1, 2).contiguous()
        self.out = LinearKernel(self.o_proj.weight, self.o_proj.bias)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary over ``x`` ``[T, H, rope]``. DeepSeek's pairs are adjacent columns: de-interleaved first, so that
        the two halves rotate together (the result is the rotated pairs laid out as halves, for q and k alike:
        their dot products are the interleaved rotation's)."""
        if self.mla.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        batch: AttentionBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``x`` ``[T, hidden]`` → ``[T, hidden]``; writes the tokens' latent rows into ``layer_cache``
        (``[num_blocks, 1, 1, B, rank + rope]``)."""
        mla, t, heads = self.mla, x.shape[0], self.num_heads
        nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, heads, nope + rope).split([nope, rope], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
        cos, sin = cos_sin
        q_rope = self._rotate(q_rope, cos, sin)
        latent = torch.cat([self.kv_a_layernorm(c), self._rotate(k_rope[:, None, :], cos, sin)[:, 0]], dim=-1)
        plane = layer_cache[:, 0]  # [num_blocks, 1, B, W]: one KV "head" of latent rows
        rows = latent[:, None, :]
        backend.write_kv(plane, plane, rows, rows, batch.slot_mapping)
        p, d = batch.num_prefill_tokens, batch.num_decode_tokens
        parts = []
        if p:
            parts.append(self._attend_absorbed(q_nope[:p], q_rope[:p], plane, batch, backend, prefill=True)
                         if self.absorbed_prefill else self._prefill_expanded(q_nope[:p], q_rope[:p], plane, batch))
        if d:
            parts.append(self._attend_absorbed(q_nope[p:], q_rope[p:], plane, batch, backend, prefill=False)
                         if self.absorbed_decode else self._decode_unabsorbed(q_nope[p:], q_rope[p:], plane, batch))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = out.reshape(t, heads * mla.v_head_dim)
        return self.out(out) if self.out is not None else self.o_proj(out)

    def _attend_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, plane: torch.Tensor, batch: AttentionBatch,
                         backend: AttentionBackend, *, prefill: bool) -> torch.Tensor:
        """Absorbed attention of the step's prefill or decode tokens (see module doc): ``[n, H, v_head_dim]``."""
        if self.w_uk is None:
            self.prepare()
        rank = self.mla.kv_lora_rank
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1), q_rope], dim=-1)  # [n, H, W]
        if prefill:
            lat = backend.prefill_attention(q, plane, plane, batch.prefill_block_tables, batch.prefill_seq_lens,
                                            batch.prefill_query_start_loc, scale=self.scale)[..., :rank]
        elif (mla_decode := getattr(backend, "mla_decode_attention", None)) is not None:
            lat = mla_decode(q, plane[:, 0], batch.decode_block_tables, batch.decode_seq_lens, kv_lora_rank=rank,
                             scale=self.scale)
        else:
            lat = backend.paged_decode_attention(q, plane, plane, batch.decode_block_tables, batch.decode_seq_lens,
                                                 scale=self.scale)[..., :rank]
        return torch.bmm(lat.transpose(0, 1).to(self.w_uv_t.dtype), self.w_uv_t).transpose(0, 1)  # [n, H, v]

    def _prefill_expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, plane: torch.Tensor,
                          batch: AttentionBatch) -> torch.Tensor:
        """Prefill tokens as transformers attends (see module doc), one sequence at a time through fused SDPA:
        ``[p, H, v_head_dim]``. Reads the sequences' lengths on the host (prefill steps are never captured)."""
        mla, heads = self.mla, self.num_heads
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        block_size = plane.shape[2]
        cache = plane[:, 0]  # [num_blocks, B, W]
        out = q_nope.new_empty((q_nope.shape[0], heads, mla.v_head_dim))
        starts = batch.prefill_query_start_loc.tolist()
        lengths = batch.prefill_seq_lens.tolist()
        for i, length in enumerate(lengths):
            start, end = starts[i], starts[i + 1]
            blocks = batch.prefill_block_tables[i, : -(-length // block_size)].long()
            rows = cache.index_select(0, blocks).reshape(-1, cache.shape[-1])[:length].to(q_nope.dtype)  # [L, W]
            kv = F.linear(rows[:, :rank], self.kv_b_proj.weight).view(length, heads, nope + mla.v_head_dim)
            keys = torch.cat([kv[..., :nope], rows[:, None, rank:].expand(length, heads, -1)], dim=-1)
            q = torch.cat([q_nope[start:end], q_rope[start:end]], dim=-1)
            new = end - start
            mask = None
            if new != length:  # after a cached prefix: query i sees keys 0 .. length - new + i
                mask = (torch.arange(length, device=q.device)[None, :]
                        <= torch.arange(length - new, length, device=q.device)[:, None])
            att = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                                 kv[..., nope:].transpose(0, 1), attn_mask=mask,
                                                 is_causal=mask is None, scale=self.scale)
            out[start:end] = att.transpose(0, 1)
        return out

    def _decode_unabsorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, plane: torch.Tensor,
                           batch: AttentionBatch) -> torch.Tensor:
        """Decode tokens the unabsorbed way (`kernels.reference.mla_unabsorbed_attention`): ``[d, H, v_head_dim]``."""
        d = q_nope.shape[0]
        starts = torch.arange(d + 1, dtype=torch.int32, device=q_nope.device)
        return reference.mla_unabsorbed_attention(
            q_nope, q_rope, plane[:, 0], self.kv_b_proj.weight, batch.decode_block_tables, batch.decode_seq_lens,
            starts, v_head_dim=self.mla.v_head_dim, scale=self.scale)


class DeepseekMoe(SparseMoe):
    """DeepSeek's MoE layer: routed experts (the checkpoint's per-expert ``gate_proj/up_proj/down_proj``,
    restacked by `SparseMoe.prepare`) chosen by `route_grouped`, plus the shared experts' one SwiGLU MLP
    (``mlp.shared_experts``) added to every token."""

    def __init__(self, config: ModelConfig, mlp: type[nn.Module]) -> None:
        """``mlp``: the decoder's SwiGLU class (`model.llama.MLP`, which builds this layer), for the shared experts."""
        super().__init__(config)
        if self.moe.score_correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(self.moe.num_experts))
        self.shared_experts = (mlp(config, intermediate_size=self.moe.shared_intermediate_size)
                               if self.moe.shared_intermediate_size else None)

    def prepare(self, *, use_triton: bool = False) -> None:
        super().prepare(use_triton=use_triton)
        if self.shared_experts is not None:
            self.shared_experts.prepare()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias if self.moe.score_correction_bias else None
        weights, ids = route_grouped(F.linear(x.float(), self.gate.weight.float()), self.moe, bias)
        if self.w_gate_up is None:
            self.prepare()
        if self.use_triton:
            from kvrelay.kernels.triton_moe import fused_experts  # lazily: Triton needs a GPU or TRITON_INTERPRET

            out = fused_experts(x, self.w_gate_up, self.w_down, weights, ids, activation=self.moe.activation)
        else:
            out = experts_grouped(x, weights, ids, self.kernels, self.moe)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


def route_grouped(logits: torch.Tensor, moe: MoeConfig,
                  correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited routing, exactly as transformers computes it (float32).

    ``sigmoid_group_topk`` (V3): scores ``sigmoid(logits)``; the choice ranks ``scores + correction_bias``;
    a group's rank is the sum of its two best; the k best experts of the ``topk_group`` best groups are taken
    with their *scores* (not biased), divided by their sum (+1e-20) when ``norm_topk_prob``.
    ``softmax_group_topk`` (V2): scores ``softmax(logits)``; a group's rank is its best score (with one group:
    plain top-k); the others' scores are zeroed before the top k. Both then multiply by
    ``routed_scaling_factor``.

    Args:
        logits: ``[T, E]`` float32 router logits.

    Returns:
        ``(weights [T, k] float32, ids [T, k] int64)``.
    """
    t, e = logits.shape
    groups = moe.num_groups
    if moe.routing == "sigmoid_group_topk":
        scores = logits.sigmoid()
        choice = scores + correction_bias.float() if correction_bias is not None else scores
        group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
        group_scores = scores.view(t, groups, e // groups).max(dim=-1).values
    if groups > 1:
        group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(t, e).bool()
        fill = float("-inf") if moe.routing == "sigmoid_group_topk" else 0.0
        choice = choice.masked_fill(~keep, fill)
    if moe.routing == "sigmoid_group_topk":
        ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids
