"""`TrainingLlama`: a small Llama in plain torch, trainable on CPU and exported in Hugging Face format.

The serving model (`model.llama.LlamaForCausalLM`) runs over a paged KV pool and cannot be trained;
this one runs whole ``[B, T]`` batches with a causal mask. Its numerics and parameter names are the
Hugging Face Llama ones, so `export_hf` writes a directory that `model.loader.load_model` loads into
the same function:

    RMSNorm            model.llama.RMSNorm (float32 normalisation, weight after the cast)
    rotary             model.rope (rotate_half convention, float32 angles, theta 10000)
    GQA attention      query head h reads KV head h // (num_heads // num_kv_heads) (HF ``repeat_kv``)
    SwiGLU MLP         down(silu(gate(x)) * up(x))
    lm_head            tied to the embeddings while training, written as its own tensor

The config, tokenizer and generation files come from `model.tiny.write_tiny_model`, whose
``config.json`` fixes ``head_dim = hidden // heads``, ``rope_theta = 10000``, ``rms_norm_eps = 1e-5``
and ``tie_word_embeddings = false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from kvrelay.model.config import RopeConfig
from kvrelay.model.llama import RMSNorm
from kvrelay.model.rope import apply_rotary, rope_inv_freq, rotary_cos_sin
from kvrelay.model.tiny import write_tiny_model
from safetensors.torch import save_file
from torch import nn

ROPE = RopeConfig(theta=10000.0)
RMS_NORM_EPS = 1e-5
MAX_POSITION_EMBEDDINGS = 2048


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The sizes of a `TrainingLlama` (``head_dim = hidden_size // num_heads``)."""

    vocab_size: int
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class _Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.self_attn = _Attention(shape)
        self.mlp = _MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, RMS_NORM_EPS)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, RMS_NORM_EPS)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _DecoderModel(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, RMS_NORM_EPS)


class TrainingLlama(nn.Module):
    """Llama decoder over padding-free ``[B, T]`` batches, every row starting at position 0.

    Parameters are initialised from the global torch RNG (seed it first): embeddings (shared with
    ``lm_head``) normal with std ``hidden_size ** -0.5`` so initial logits are O(1), linear layers with
    PyTorch's default, norms at 1.
    """

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        if shape.hidden_size % shape.num_heads or shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"{shape}: hidden_size must divide by num_heads, num_heads by num_kv_heads")
        self.shape = shape
        self.model = _DecoderModel(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        nn.init.normal_(self.model.embed_tokens.weight, std=shape.hidden_size**-0.5)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("rope_inv_freq", rope_inv_freq(ROPE, shape.head_dim), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[B, T]`` int64 → final-norm hidden states ``[B, T, hidden_size]`` float32."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rotary_cos_sin(self.rope_inv_freq, positions, dtype=torch.float32)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named float32 tensors (``lm_head.weight`` a copy of the embeddings), sorted by name."""
        return {name: t.detach().to(torch.float32).clone().contiguous()
                for name, t in sorted(self.state_dict(keep_vars=False).items())}


def export_hf(model: TrainingLlama, out_dir: Path) -> Path:
    """Write ``model`` into ``out_dir`` as a Hugging Face Llama directory `model.loader` loads.

    ``config.json`` and the byte-level tokenizer come from `model.tiny.write_tiny_model` (ids 0..255
    bytes, 256 BOS, 257 EOS, higher ids only in the embedding table); ``model.safetensors`` then holds
    ``model``'s weights. Same weights → byte-identical files.
    """
    s = model.shape
    write_tiny_model(out_dir, layers=s.num_layers, hidden=s.hidden_size, heads=s.num_heads, kv_heads=s.num_kv_heads,
                     vocab=s.vocab_size, intermediate=s.intermediate_size,
                     max_position_embeddings=MAX_POSITION_EMBEDDINGS)
    save_file(model.hf_weights(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir

