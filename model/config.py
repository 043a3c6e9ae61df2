"""`ModelConfig`: the parts of a Hugging Face ``config.json`` the decoder needs.

Supported families: ``llama`` (Llama 2 / 3.x), ``mistral`` and ``qwen2`` — all the same decoder
(RMSNorm, rotary, GQA attention, SwiGLU MLP) differing only in biases, tying and rope settings.

Rope settings are read from either form a checkpoint may use::

    classic (published checkpoints)      transformers 5.x `save_pretrained`
    "rope_theta": 500000.0,              "rope_parameters": {"rope_type": "llama3",
    "rope_scaling": {"rope_type": ...}                       "rope_theta": 500000.0, ...}
                   (or {"type": ...})

Sliding-window attention (Mistral v0.1, Qwen2 with ``use_sliding_window``) is not implemented: the
decoder always attends over the whole sequence, which is exact while every position is inside the
window. `ModelConfig.sliding_window_tokens` records the window, `max_context_tokens` is capped by it,
and the model refuses positions at or past it instead of silently computing different attention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu",)
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings.

    Attributes:
        theta: the base wavelength (``rope_theta``).
        rope_type: one of `SUPPORTED_ROPE_TYPES`.
        factor: frequency divisor for ``linear`` and ``llama3`` (1.0 for ``default``).
        low_freq_factor, high_freq_factor, original_max_position_embeddings: ``llama3`` only
            (see `model.rope.rope_inv_freq`); 0 otherwise.
    """

    theta: float = DEFAULT_ROPE_THETA
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. Build it with `ModelConfig.from_hf_dict`.

    Attributes:
        qkv_bias: q/k/v projections carry a bias (Qwen2 always; Llama when ``attention_bias``).
        o_bias: the output projection carries a bias (Llama ``attention_bias`` only).
        eos_token_ids: every end-of-sequence id (``eos_token_id`` may be an int or a list).
        sliding_window_tokens: the attention window if any layer uses one, else None (see module doc).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def max_context_tokens(self) -> int:
        """Longest sequence served exactly: ``max_position_embeddings``, capped by a sliding window."""
        if self.sliding_window_tokens is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window_tokens)

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict.

        Raises:
            ValueError: unsupported model type, activation, rope type or partial rotary; a missing
                required key; an inconsistent shape. The message names the key and what is supported.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = config.get("architectures") or []
            raise ValueError(
                f"config.json: model_type {model_type!r} (architectures {archs}) is not supported; "
                f"supported model types: {list(SUPPORTED_MODEL_TYPES)}"
            )
        act = config.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"config.json: hidden_act {act!r} is not supported; use one of {list(SUPPORTED_ACTIVATIONS)}"
            )

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"config.json: required key {key!r} is missing")
            return config[key]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        head_dim = config.get("head_dim") or hidden_size // num_heads
        num_layers = int(need("num_hidden_layers"))
        max_positions = int(config.get("max_position_embeddings", 2048))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        bos = config.get("bos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope=_parse_rope(config, max_positions),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_window_tokens=_parse_sliding_window(config, model_type, num_layers),
        )


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``model_dir/config.json``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``model_dir`` (the path is named).
        ValueError: see `ModelConfig.from_hf_dict`; also invalid JSON.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; a model directory needs a Hugging Face config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return ModelConfig.from_hf_dict(config)


def _parse_rope(config: dict[str, Any], max_positions: int) -> RopeConfig:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json: per-layer-type rope parameters {sorted(params)} are not supported")
    theta = float(params.get("rope_theta") or config.get("rope_theta") or DEFAULT_ROPE_THETA)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported; supported rope types: "
            f"{list(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor {partial!r} is not supported; only 1.0")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    original_key = "original_max_position_embeddings"
    original = params.get(original_key) or config.get(original_key)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original or max_positions),
    )


def _parse_sliding_window(config: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    window = config.get("sliding_window")
    if window is None or model_type == "llama":
        return None
    if model_type == "qwen2":
        layer_types = config.get("layer_types")
        if layer_types is not None:
            uses_window = "sliding_attention" in layer_types
        else:
            uses_window = bool(config.get("use_sliding_window")) and int(
                config.get("max_window_layers", num_layers)
            ) < num_layers
        if not uses_window:
            return None
    return int(window)
