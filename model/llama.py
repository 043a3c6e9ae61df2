"""`LlamaForCausalLM`: the decoder of every supported family (`model.config`) over a paged KV pool.

Llama, Mistral and Qwen2 are the plain decoder; Qwen3 adds per-head q/k RMSNorm; Qwen3-MoE, Mixtral
and gpt-oss replace the MLP by a mixture of experts (`model.moe.SparseMoe`); gpt-oss adds attention
sinks; sliding-window layers pass their window to the attention kernels. DeepSeek-V2/V3 replace the
attention by multi-head latent attention and the MLP by experts with shared experts (`model.deepseek`).

One call of `LlamaForCausalLM.forward` is one model step over a flat batch of tokens (no padding),
laid out as `model.attention.AttentionBatch` describes. Parameter names are exactly the Hugging Face
ones (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``), so loading a checkpoint is a
straight name match (`model.loader`).

Numerics follow transformers: RMSNorm in float32 then cast back, rotary angles in float32, attention
math in float32 (the backends accumulate in float32).
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from kvrelay.kernels import cpu_small
from kvrelay.model.attention import AttentionBackend, AttentionBatch, TorchBackend, paged_attention
from kvrelay.model.config import ModelConfig
from kvrelay.model.deepseek import DeepseekMoe, MlaAttention
from kvrelay.model.kernel_plan import FEW_ROW_BUCKETS, FEW_ROWS, KernelPlan, bucket_of
from kvrelay.model.linear_kernel import LinearKernel, colocate_blocked
from kvrelay.model.moe import SparseMoe
from kvrelay.model.rope import RotaryRows, apply_rotary, rope_inv_freq, rotary_cos_sin
from torch import nn


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x²) + eps))``, normalised in float32 and cast back before scaling (Llama),
    or scaled in float32 and then cast (``scale_in_float32``: gpt-oss, whose norms stay float32)."""

    def __init__(self, hidden_size: int, eps: float, *, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32
        self.fast: ModuleType | None = None  # set by `prepare`

    def prepare(self) -> None:
        """Take the one-pass C++ RMSNorm (`kernels.cpu_small`) when the weight is a float32 CPU tensor, or a bf16
        one scaled after the cast back (Llama's order), and the extension built; same math."""
        w = self.weight
        takes = w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and not self.scale_in_float32)
        self.fast = cpu_small.load() if takes and w.device.type == "cpu" and w.is_contiguous() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is not None and x.dtype == self.weight.dtype and x.device.type == "cpu":
            return cpu_small.rms_norm(self.fast, x, self.weight, self.eps)
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        if self.scale_in_float32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention; reads and writes this layer's slice of the KV pool.

    ``window``: this layer's sliding window in tokens, or None (full attention). ``q_norm``/``k_norm``
    (Qwen3): RMSNorm over each head's ``head_dim`` before rotary. ``sinks`` (gpt-oss): one logit per
    query head in every softmax, passed to the kernels in float32.
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))
        self.has_sinks = config.attention_sinks
        self.window = config.layer_window(layer_idx)
        self.qkv: LinearKernel | None = None  # set by `prepare`
        self.out: LinearKernel | None = None
        self.small_ops: ModuleType | None = None
        self.sinks_f32: torch.Tensor | None = None

    def prepare(self) -> None:
        """One ``[q; k; v]`` weight (and bias) for one matmul a step (q/k/v_proj become views of it), and
        the fastest matmul kernels for it and o_proj."""
        self.qkv = LinearKernel(*_fuse_linears(self.q_proj, self.k_proj, self.v_proj))
        self.out = LinearKernel(self.o_proj.weight, self.o_proj.bias)
        self.small_ops = _small_ops_for(self.o_proj.weight)
        if self.has_sinks:
            self.sinks_f32 = self.sinks.detach().float().contiguous()

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        batch: AttentionBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``x`` ``[T, hidden]`` → ``[T, hidden]``; writes the tokens' KV into ``layer_cache``."""
        t, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = cos_sin
        if self.qkv is not None and not self.qk_norm:  # q and k side by side: one rotation for both
            qk, v = self.qkv(x).split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
            q, k = self._rotate(qk.reshape(t, heads + kv_heads, dim), cos, sin).split([heads, kv_heads], dim=1)
        else:
            if self.qkv is not None:
                q, k, v = self.qkv(x).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k = q.reshape(t, heads, dim), k.reshape(t, kv_heads, dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        v = v.reshape(t, kv_heads, dim)
        sinks = None
        if self.has_sinks:
            sinks = self.sinks_f32 if self.sinks_f32 is not None else self.sinks.float()
        out = paged_attention(backend, q, k, v, layer_cache, batch, scale=self.scale, layer=self.layer_idx,
                              window=self.window, sinks=sinks)
        out = out.reshape(t, self.num_heads * self.head_dim)
        return self.out(out) if self.out is not None else self.o_proj(out)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rotary`, in one C++ pass where `prepare` found the CPU kernels (same bits)."""
        if self.small_ops is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return cpu_small.rotary(self.small_ops, x, cos, sin)
        return apply_rotary(x, cos, sin)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``intermediate_size`` wide (default: the config's)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = config.mlp_bias
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)
        self.gate_up: LinearKernel | None = None  # set by `prepare`
        self.down: LinearKernel | None = None
        self.small_ops: ModuleType | None = None

    def prepare(self) -> None:
        """One ``[gate; up]`` weight for one matmul a step (gate/up_proj become views of it), and the
        fastest matmul kernels for it and down_proj."""
        self.gate_up = LinearKernel(*_fuse_linears(self.gate_proj, self.up_proj))
        self.down = LinearKernel(self.down_proj.weight, self.down_proj.bias)
        self.small_ops = _small_ops_for(self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.down is not None:
            gate_up = self.gate_up(x)
            if (self.small_ops is not None and gate_up.dim() == 2 and gate_up.device.type == "cpu"
                    and gate_up.dtype in (torch.float32, torch.bfloat16)):
                return self.down(cpu_small.silu_mul(self.small_ops, gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _small_ops_for(weight: torch.Tensor) -> ModuleType | None:
    """The C++ CPU kernels (`kernels.cpu_small`) for a layer whose weights are float32 or bf16 on the CPU, else
    None (torch's ops)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_small.load()


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along the output dimension and re-point each
    layer's parameters at its slice, so the fused tensors are the only copy (names stay Hugging Face's)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``. The attention is GQA (`Attention`) or
    multi-head latent (`model.deepseek.MlaAttention`); the MLP is dense or a mixture of experts
    (`model.moe.SparseMoe`, `model.deepseek.DeepseekMoe`), under the checkpoint's name (``block_sparse_moe``
    for Mixtral, ``mlp`` otherwise); `ffn` is it whatever its name."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = (MlaAttention(config, layer_idx, RMSNorm) if config.mla is not None
                          else Attention(config, layer_idx))
        sparse = config.moe is not None and config.moe.sparse_layers[layer_idx]
        self.ffn_name = "block_sparse_moe" if config.model_type == "mixtral" else "mlp"
        if not sparse:
            ffn: nn.Module = MLP(config)
        elif config.model_type.startswith("deepseek"):
            ffn = DeepseekMoe(config, MLP)
        else:
            ffn = SparseMoe(config)
        setattr(self, self.ffn_name, ffn)
        f32 = config.norm_scale_in_float32
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=f32)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=f32)
        # (extension, arguments before the step's, arguments after) of `decode_fused`; set by `prepare_fused`
        self.fused: tuple[ModuleType, tuple, tuple] | None = None

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        batch: AttentionBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        hook, p = batch.kv_hook, batch.num_prefill_tokens
        if hook is not None and batch.num_decode_tokens:
            hook.layer_input(self.self_attn.layer_idx, x[p:], (cos_sin[0][p:], cos_sin[1][p:]))
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, layer_cache, batch, backend)
        return x + self.ffn(self.post_attention_layernorm(x))

    def prepare_fused(self) -> None:
        """After the sub-modules' `prepare`: take the one-call C++ layer (`decode_fused`) when this layer is plain
        GQA attention (no q/k norm, no sinks) and a dense MLP whose four weights have blocked copies
        (`model.linear_kernel`: bf16 or float32) and whose norms run in C++ in the weights' dtype; else keep
        ``fused`` None."""
        attn, ffn = self.self_attn, self.ffn
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if not (isinstance(attn, Attention) and isinstance(ffn, MLP) and not attn.qk_norm and not attn.has_sinks
                and all(n.fast is not None for n in norms) and norms[0].eps == norms[1].eps):
            return
        kernels = (attn.qkv, attn.out, ffn.gate_up, ffn.down)
        if any(k is None or k.blocked is None or k.blocked.dtype != n.weight.dtype for k in kernels for n in norms):
            return
        qkv, out, gate_up, down = kernels
        dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim, ffn.down_proj.weight.shape[1]]
        before = (norms[0].weight, norms[1].weight, norms[0].eps, qkv.blocked, qkv.bias, out.blocked, out.bias,
                  gate_up.blocked, gate_up.bias, down.blocked, down.bias, dims)
        self.fused = (qkv.blocked_ext, before, (attn.scale, attn.window or 0))

    def decode_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor,
                     batch: AttentionBatch) -> torch.Tensor:
        """`forward` for a step of 1 to 16 decode tokens (where the kernel plan takes the C++ path) and no KV hook,
        in one C++ call (``kernels/csrc/decode_layer.cpp``): the same kernels in the same order, the same bits,
        without ~35 torch ops and Python calls a layer. Needs ``fused`` (`prepare_fused`)."""
        assert self.fused is not None
        ext, before, after = self.fused
        return ext.decode_layer(x, *before, cos, sin, layer_cache, batch.slot_mapping, batch.decode_block_tables,
                                batch.decode_seq_lens, *after)


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=config.norm_scale_in_float32)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV pool.

    Build it with `model.loader.load_model`; constructing it directly gives PyTorch's default init
    (useful under ``torch.device("meta")``). ``rope_inv_freq`` is a non-persistent float32 buffer
    computed from the config at construction, on CPU even under a meta device context.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head: LinearKernel | None = None  # set by `prepare_for_inference`
        # every layer as one C++ call a decode step (`decode_layers`); set by `prepare_for_inference` when all fuse
        self.decode_stack: Any = None
        self.stack_norms = False  # whether `decode_stack` applies the final norm too (`prepare_for_inference`)
        self.stack_logits = False  # whether it runs the embedding and head too (`decode_logits`)
        self.rotary_rows: RotaryRows | None = None  # `decode_logits`'s cos and sin, built on its first call
        # `fuses_decode_logits`'s last pool and backend, and whether the C++ kernels take steps on them
        self._fuses_with: tuple[weakref.ref, AttentionBackend] | None = None
        self._fuses_kernels = False
        # the paths of its steps (`model.kernel_paths.apply_kernel_plan`); until then the built-in rule: the one-call
        # stack at 1-16 rows
        self.kernel_plan: KernelPlan | None = None
        self.stack_by_bucket: tuple[bool, ...] = (True,) * FEW_ROW_BUCKETS
        self.register_buffer("rope_inv_freq", rope_inv_freq(config.rope, config.head_dim), persistent=False)
        self.kv_place = {layer: (g, local) for g, group in enumerate(config.kv_groups)
                         for local, layer in enumerate(group.layers)}  # layer -> (KV block group, local layer)
        # Parameters loaded in float32 whatever the model's dtype (suffixes of their names): DeepSeek's router, as
        # transformers keeps it (its correction bias decides the experts; bf16 rounding would change the choice).
        self.float32_parameters: tuple[str, ...] = (
            (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias") if config.model_type.startswith("deepseek")
            else ())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        batch: AttentionBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Run one step and return the final-norm hidden states.

        Args:
            input_ids: ``[T]`` int64 token ids, laid out as ``batch`` describes.
            positions: ``[T]`` int64 position of each token in its sequence.
            kv_pool: ``[num_blocks, layers per block, planes, heads, block_size_tokens, width]`` as
                `ModelConfig.kv_planes` says (K and V: ``2, num_kv_heads, head_dim``; MLA: one latent row): a
                block holds the layers of one `ModelConfig.kv_groups` group (all layers with one group);
                layer i is local layer ``kv_place[i][1]`` of group ``kv_place[i][0]``'s blocks, read and
                written through ``batch.for_group(group)``. Mutated: every token's key and value are
                written at the slot mappings.
            batch: the step's attention metadata.
            backend: the attention kernels (`model.attention.make_backend`). Nothing here reads a
                device value back on the host, so a step can be captured in a CUDA graph.

        Returns:
            ``[T, hidden_size]`` in the model's dtype, after the final RMSNorm; pass the rows whose
            next token is wanted to `compute_logits`.

        Raises:
            ValueError: the pool has the wrong number of layers.
        """
        self._check_pool(kv_pool)
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, x.dtype)
        fused = self._fused_step(x.shape[0], x.dtype, x.device, kv_pool, batch, backend)
        if fused and self.decode_stack is not None:
            hidden = self.decode_layers(x, cos_sin, kv_pool, batch)
            return hidden if self.stack_norms else self.model.norm(hidden)
        for i, layer in enumerate(self.model.layers):
            group, local = self.kv_place[i]
            if fused and layer.fused is not None:
                x = layer.decode_fused(x, *cos_sin, kv_pool[:, local], batch.for_group(group))
            else:
                x = layer(x, cos_sin, kv_pool[:, local], batch.for_group(group), backend)
        return self.model.norm(x)

    def _check_pool(self, kv_pool: torch.Tensor) -> None:
        per_block = len(self.config.kv_groups[0].layers)
        if kv_pool.shape[1] != per_block:
            raise ValueError(f"kv_pool blocks hold {kv_pool.shape[1]} layers; the model's hold {per_block}")

    def fuses_decode_logits(self, rows: int, kv_pool: torch.Tensor, backend: AttentionBackend) -> bool:
        """Whether a decode-only step of ``rows`` sequences without a KV hook (H2O, InfiniGen) runs through
        `decode_logits`: the stack has a head (`stack_logits`), the plan takes the stack at ``rows``
        (`stack_by_bucket`) and the C++ kernels take the step (`fuses_on`)."""
        if self.decode_stack is None or not self.stack_logits or not 0 < rows <= FEW_ROWS:
            return False
        if not self.stack_by_bucket[bucket_of(rows)]:
            return False
        # what else it asks changes with neither the pool nor the backend: asked once for them (asked each step, its
        # cold attribute lookups cost ~40 us of a batch-1 bf16 SmolLM2 step on a Zen 4 VM)
        seen = self._fuses_with
        if seen is None or seen[0]() is not kv_pool or seen[1] is not backend:
            weight = self.model.embed_tokens.weight
            self._fuses_with = (weakref.ref(kv_pool), backend)  # a weak reference: the pool is the engine's to free
            self._fuses_kernels = self.fuses_on(weight.dtype, weight.device, kv_pool, backend)
        return self._fuses_kernels

    def decode_logits(self, input_ids: list[int], positions: list[int], kv_pool: torch.Tensor,
                      slots: list[list[int]], tables: list[list[list[int]]], lens: list[int]
                      ) -> tuple[torch.Tensor, list[int]]:
        """`forward` then `compute_logits` of a decode-only step (every row samples) in one C++ call
        (``DecodeStack.logits``: the embedding lookup, every layer, the final norm and the head in one parallel
        region), for a step `fuses_decode_logits` accepts. The step comes as lists, not an `AttentionBatch`: per KV
        block group, each sequence's slot (``slots[group][t]``) and block table (``tables[group][t]``, ragged: the
        call pads it); each sequence's KV length with this token (``lens``); no tensor is built for them in Python,
        and the rotary rows come from `model.rope.RotaryRows`. Returns float32 ``[T, vocab_size]``, the bits
        `forward` then `compute_logits` give, and each row's ``torch.argmax`` (its greedy token, found while the
        row is in the cache).

        Between the layers and the head a separate call cost the head's Python and a parallel region of its own,
        both run with cold caches after the step has streamed the weights: a batch-1 bf16 SmolLM2 step on a Zen 4
        VM spent ~1.3 ms in `compute_logits` for a ~1.0 ms read of its 57 MB; the step's metadata tensors and
        `AttentionBatch` cost another ~0.2 ms, also cold.

        Raises:
            ValueError: the pool has the wrong number of layers.
            RuntimeError: a token id outside the vocabulary, or a slot, block table or shape that does not fit.
        """
        self._check_pool(kv_pool)
        dtype = self.model.embed_tokens.weight.dtype
        if self.rotary_rows is None or self.rotary_rows.dtype != dtype:
            self.rotary_rows = RotaryRows(self.rope_inv_freq, dtype=dtype, scaling=self.config.rope.attention_factor)
        cos, sin, rows = self.rotary_rows.rows(positions)
        return self.decode_stack.logits(input_ids, rows, cos, sin, kv_pool, slots, tables, lens)

    def decode_layers(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_pool: torch.Tensor,
                      batch: AttentionBatch) -> torch.Tensor:
        """Every decoder layer of a `_fused_step` step in one C++ call (``DecodeStack`` in
        ``kernels/csrc/decode_layer.cpp``): each layer exactly as `DecoderLayer.decode_fused` runs it, the same bits,
        without a Python call a layer, all of them in one parallel region of torch's thread count. ``x``
        ``[T, hidden]`` → the last layer's output, through the final norm when `stack_norms` (the same kernel as
        `RMSNorm`'s, in the same call); needs `decode_stack`."""
        return self.decode_stack.forward(x, *cos_sin, kv_pool, *self._stack_tables(batch))

    def _stack_tables(self, batch: AttentionBatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """What ``DecodeStack`` reads of a step's metadata: per KV block group, its slot mapping, decode block
        tables and decode lengths."""
        groups = [batch.for_group(g) for g in range(len(self.config.kv_groups))]
        return ([b.slot_mapping for b in groups], [b.decode_block_tables for b in groups],
                [b.decode_seq_lens for b in groups])

    def _fused_step(self, rows: int, dtype: torch.dtype, device: torch.device, kv_pool: torch.Tensor,
                    batch: AttentionBatch, backend: AttentionBackend) -> bool:
        """Whether this step's layers may run as one C++ call each (`DecoderLayer.decode_fused`) or all in one
        (`decode_layers`): only decode tokens, no KV hook (H2O, InfiniGen), 1 to 16 of them where the plan takes
        the stack (`stack_by_bucket`), and `fuses_on`."""
        return (batch.num_prefill_tokens == 0 and batch.kv_hook is None and batch.step_block_tables is None
                and 0 < rows <= FEW_ROWS and self.stack_by_bucket[bucket_of(rows)]
                and self.fuses_on(dtype, device, kv_pool, backend))

    @staticmethod
    def fuses_on(dtype: torch.dtype, device: torch.device, kv_pool: torch.Tensor,
                  backend: AttentionBackend) -> bool:
        """Whether the C++ layer kernels can run a decode-only step: bf16 or float32 activations (``dtype``) and
        KV of that dtype on the CPU, and the CPU backend with its C++ decode attention."""
        return (dtype in (torch.bfloat16, torch.float32) and kv_pool.dtype == dtype
                and device.type == "cpu" and isinstance(backend, TorchBackend)
                and backend.cpu_decode_kernels is not None)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[T, head_dim]`` of ``positions`` for this model's rope (yarn's factor applied)."""
        return rotary_cos_sin(self.rope_inv_freq, positions, dtype=dtype, scaling=self.config.rope.attention_factor)

    def prepare_for_inference(self) -> None:
        """Merge q/k/v and gate/up into one matmul each (fewer, larger matmuls a step: on a CPU every
        matmul is a parallel region whose threads wait for each other) and pick each weight's fastest
        matmul kernel (`model.linear_kernel`) and each RMSNorm's (`RMSNorm.prepare`); restack the experts of
        MoE layers (`model.moe.SparseMoe`, through the Triton fused-MoE kernel when the weights are on CUDA).
        Same results; call once, after loading."""
        for layer in self.model.layers:
            layer.self_attn.prepare()
            if isinstance(layer.ffn, SparseMoe):
                layer.ffn.prepare(use_triton=self.lm_head.weight.is_cuda)
            else:
                layer.ffn.prepare()
        self.head = LinearKernel(self.lm_head.weight, None)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.prepare()
        # The few-row copies on huge pages, in the order a decode step reads them: the layers', then the head's
        colocate_blocked([v for module in self.model.layers.modules() for v in vars(module).values()
                          if isinstance(v, LinearKernel)] + [self.head])
        for layer in self.model.layers:
            layer.prepare_fused()
        self.decode_stack, self.stack_norms, self.stack_logits = None, False, False
        if all(layer.fused is not None for layer in self.model.layers):
            stack = self.model.layers[0].fused[0].DecodeStack()
            for i, layer in enumerate(self.model.layers):
                _, before, after = layer.fused
                stack.add_layer(*before, *after, *self.kv_place[i])
            norm = self.model.norm
            if norm.fast is not None and norm.weight.dtype == before[0].dtype:  # the same kernel, in the stack's call
                stack.set_final_norm(norm.weight, norm.eps)
                self.stack_norms = True
                embedding, head = self.model.embed_tokens.weight, self.head
                if (head.blocked is not None and head.bias is None and embedding.dtype == norm.weight.dtype
                        and embedding.is_contiguous()):
                    stack.set_ends(embedding, head.blocked, self.lm_head.weight.shape[0])
                    self.stack_logits = True
            self.decode_stack = stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → float32 ``[N, vocab_size]``."""
        return (self.head(hidden) if self.head is not None else self.lm_head(hidden)).float()
