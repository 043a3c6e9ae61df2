"""`LlamaForCausalLM`: the Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV pool.

One call of `LlamaForCausalLM.forward` is one model step over a flat batch of tokens (no padding),
laid out as `model.attention.AttentionBatch` describes. Parameter names are exactly the Hugging Face
ones (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``), so loading a checkpoint is a
straight name match (`model.loader`).

Numerics follow transformers: RMSNorm in float32 then cast back, rotary angles in float32, attention
math in float32 (the backends accumulate in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionBackend, AttentionBatch, paged_attention
from model.config import ModelConfig
from model.linear_kernel import LinearKernel
from model.rope import apply_rotary, rope_inv_freq, rotary_cos_sin


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x²) + eps))``, normalised in float32 and cast back before scaling."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)  # one fused op, same math
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention; reads and writes this layer's slice of the KV pool."""

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
        self.qkv: LinearKernel | None = None  # set by `prepare`
        self.out: LinearKernel | None = None

    def prepare(self) -> None:
        """One ``[q; k; v]`` weight (and bias) for one matmul a step (q/k/v_proj become views of it), and
        the fastest matmul kernels for it and o_proj."""
        self.qkv = LinearKernel(*_fuse_linears(self.q_proj, self.k_proj, self.v_proj))
        self.out = LinearKernel(self.o_proj.weight, self.o_proj.bias)

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
        if self.qkv is not None:  # q and k side by side: one rotation for both
            qk, v = self.qkv(x).split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
            q, k = apply_rotary(qk.reshape(t, heads + kv_heads, dim), cos, sin).split([heads, kv_heads], dim=1)
        else:
            q = apply_rotary(self.q_proj(x).reshape(t, heads, dim), cos, sin)
            k = apply_rotary(self.k_proj(x).reshape(t, kv_heads, dim), cos, sin)
            v = self.v_proj(x)
        v = v.reshape(t, kv_heads, dim)
        out = paged_attention(backend, q, k, v, layer_cache, batch, scale=self.scale, layer=self.layer_idx)
        out = out.reshape(t, self.num_heads * self.head_dim)
        return self.out(out) if self.out is not None else self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up: LinearKernel | None = None  # set by `prepare`
        self.down: LinearKernel | None = None

    def prepare(self) -> None:
        """One ``[gate; up]`` weight for one matmul a step (gate/up_proj become views of it), and the
        fastest matmul kernels for it and down_proj."""
        self.gate_up = LinearKernel(*_fuse_linears(self.gate_proj, self.up_proj))
        self.down = LinearKernel(self.down_proj.weight, self.down_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.down is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


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
        self.register_buffer("rope_inv_freq", rope_inv_freq(config.rope, config.head_dim), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        batch: AttentionBatch,
        backend: AttentionBackend,
        *,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Run one step and return the final-norm hidden states.

        Args:
            input_ids: ``[T]`` int64 token ids, laid out as ``batch`` describes.
            positions: ``[T]`` int64 position of each token in its sequence.
            kv_pool: ``[num_blocks, num_layers, 2, num_kv_heads, block_size_tokens, head_dim]``.
                Mutated: every token's key and value are written at ``batch.slot_mapping``.
            batch: the step's attention metadata.
            backend: the attention kernels (`model.attention.make_backend`).
            max_position: the largest of ``positions`` when the caller knows it (checked against a sliding
                window without reading ``positions`` back from the device: a sync, which CUDA-graph capture
                forbids; the caller that passes it has called `check_positions`).

        Returns:
            ``[T, hidden_size]`` in the model's dtype, after the final RMSNorm; pass the rows whose
            next token is wanted to `compute_logits`.

        Raises:
            ValueError: the config has a sliding window and a position is at or past it (see
                `model.config`); the pool has the wrong number of layers.
        """
        config = self.config
        if kv_pool.shape[1] != config.num_hidden_layers:
            raise ValueError(
                f"kv_pool has {kv_pool.shape[1]} layers; the model has {config.num_hidden_layers}"
            )
        if config.sliding_window_tokens is not None and positions.numel():
            self.check_positions(int(positions.max()) if max_position is None else max_position)
        x = self.model.embed_tokens(input_ids)
        cos_sin = rotary_cos_sin(self.rope_inv_freq, positions, dtype=x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, kv_pool[:, i], batch, backend)
        return self.model.norm(x)

    def check_positions(self, max_position: int) -> None:
        """Raises ValueError when ``max_position`` is at or past the model's sliding window (sliding-window
        attention is not implemented, so sequences are limited to the window)."""
        window = self.config.sliding_window_tokens
        if window is not None and max_position >= window:
            raise ValueError(
                f"position {max_position} is past the model's sliding window of {window} tokens; "
                f"sliding-window attention is not implemented, so sequences are limited to {window} tokens"
            )

    def prepare_for_inference(self) -> None:
        """Merge q/k/v and gate/up into one matmul each (fewer, larger matmuls a step: on a CPU every
        matmul is a parallel region whose threads wait for each other) and pick each weight's fastest
        matmul kernel (`model.linear_kernel`). Same results; call once, after loading."""
        for layer in self.model.layers:
            layer.self_attn.prepare()
            layer.mlp.prepare()
        self.head = LinearKernel(self.lm_head.weight, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → float32 ``[N, vocab_size]``."""
        return (self.head(hidden) if self.head is not None else self.lm_head(hidden)).float()
