"""`ModelConfig`: the parts of a Hugging Face ``config.json`` the decoder needs.

Supported families, all one pre-norm decoder (RMSNorm, rotary, GQA attention) with per-family parts::

    llama, mistral, qwen2     SwiGLU MLP; biases, tying and rope settings differ
    qwen3                     + per-head RMSNorm of q and k before rotary (q_norm, k_norm)
    qwen3_moe                 + q/k norm; mixture-of-experts MLP (softmax, top-k, optional renormalise)
                              on the layers `MoeConfig.sparse_layers` names, dense SwiGLU on the others
    mixtral                   mixture-of-experts MLP (softmax, top-2, renormalised)
    gpt_oss                   attention biases and learned per-head sinks, alternating sliding/full
                              layers, yarn rope; experts with biases and a clamped SwiGLU, routed by
                              a softmax over the top-k router logits (router with a bias)
    deepseek_v3, deepseek_v2  multi-head latent attention (`MlaConfig`: one cached latent row per token and
                              layer instead of K and V heads), yarn rope with its softmax mscale; the
                              first ``first_k_dense_replace`` layers dense, then experts plus shared experts,
                              routed group-limited (V3: sigmoid scores + a correction bias, top-2 sum per
                              group; V2: softmax, greedy or max per group) and scaled by
                              ``routed_scaling_factor``

Rope settings are read from either form a checkpoint may use::

    classic (published checkpoints)      transformers 5.x `save_pretrained`
    "rope_theta": 500000.0,              "rope_parameters": {"rope_type": "llama3",
    "rope_scaling": {"rope_type": ...}                       "rope_theta": 500000.0, ...}
                   (or {"type": ...})

Sliding-window attention: each layer is ``full_attention`` or ``sliding_attention``
(`ModelConfig.layer_types`); a sliding layer's query at position i sees keys i − W < j ≤ i with
W = `ModelConfig.sliding_window_tokens`, as transformers masks them. Mistral and Mixtral (with a window)
and Qwen3-MoE (``use_sliding_window``) slide on every layer; Qwen2/Qwen3 on the layers from
``max_window_layers`` on (or as ``layer_types`` says); gpt-oss on the layers ``layer_types`` names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss",
                                         "deepseek_v3", "deepseek_v2")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
MOE_ACTIVATIONS: tuple[str, ...] = ("silu", "swiglu_oai")
MOE_ROUTINGS: tuple[str, ...] = ("softmax_topk", "topk_softmax", "sigmoid_group_topk", "softmax_group_topk")
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu",)
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings.

    Attributes:
        theta: the base wavelength (``rope_theta``).
        rope_type: one of `SUPPORTED_ROPE_TYPES`.
        factor: frequency divisor for ``linear`` and ``llama3`` (1.0 for ``default``).
        low_freq_factor, high_freq_factor: ``llama3`` only (see `model.rope.rope_inv_freq`); 0 otherwise.
        original_max_position_embeddings: ``llama3`` and ``yarn``; 0 otherwise.
        beta_fast, beta_slow, truncate: ``yarn`` only: the ramp between extrapolated and interpolated
            frequencies (transformers' defaults 32, 1, True).
        attention_factor: ``yarn`` only: the factor cos and sin are multiplied by (transformers'
            ``attention_scaling``; from ``factor`` and ``mscale``/``mscale_all_dim`` when the config
            does not give it); 1.0 for the other types.
    """

    theta: float = DEFAULT_ROPE_THETA
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class KvGroup:
    """Layers whose KV shares block tables (`ModelConfig.kv_groups`).

    Attributes:
        layers: the model's layer indices, ascending; the i-th is the block's local layer i.
        window: the sliding window every layer of the group attends over, or None (full attention, or a
            group whose blocks are never freed early).
    """

    layers: tuple[int, ...]
    window: int | None


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP (`model.moe`).

    Attributes:
        num_experts: experts per MoE layer (``num_experts`` / ``num_local_experts``).
        top_k: experts each token is routed to (``num_experts_per_tok``).
        intermediate_size: one expert's hidden width (``moe_intermediate_size`` for Qwen3-MoE, else
            ``intermediate_size``).
        routing: ``softmax_topk`` (Mixtral, Qwen3-MoE: softmax over all router logits in float32, then
            the top k, renormalised to sum 1 when ``norm_topk_prob``) or ``topk_softmax`` (gpt-oss: the
            top k logits, then a softmax over those k).
        norm_topk_prob: renormalise the chosen probabilities (``softmax_topk`` only).
        router_bias, expert_bias: the router / the experts' projections carry a bias (gpt-oss).
        activation: ``silu`` (``silu(gate) * up``) or ``swiglu_oai`` (gpt-oss: gate clamped above at
            ``swiglu_limit``, up clamped to ±``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``).
        sparse_layers: per layer, True where the MLP is the mixture (Qwen3-MoE's ``mlp_only_layers``
            and ``decoder_sparse_step`` leave some layers dense).
        num_groups, topk_group: DeepSeek's group-limited routing (``sigmoid_group_topk``,
            ``softmax_group_topk``): the experts fall in ``num_groups`` equal groups and each token chooses
            among the experts of its ``topk_group`` best groups only (1 and 1 for other routings).
        routed_scaling_factor: the chosen weights are multiplied by it (DeepSeek; 1.0 otherwise).
        shared_intermediate_size: width of the shared experts' one SwiGLU MLP added to every token's output
            (DeepSeek: ``moe_intermediate_size * n_shared_experts``), or 0 for none.
        score_correction_bias: the router has ``e_score_correction_bias`` [E], added to the scores for the
            choice only (DeepSeek-V3).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str
    norm_topk_prob: bool
    router_bias: bool
    expert_bias: bool
    activation: str
    sparse_layers: tuple[bool, ...]
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    score_correction_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_groups <= 0 or self.num_experts % self.num_groups or not 0 < self.topk_group <= self.num_groups:
            raise ValueError(f"config.json: n_group ({self.num_groups}) must divide the {self.num_experts} experts "
                             f"and topk_group ({self.topk_group}) must be in 1..n_group")
        if self.num_groups > 1 and self.routing == "sigmoid_group_topk" and self.num_experts // self.num_groups < 2:
            raise ValueError("config.json: DeepSeek-V3 routing scores a group by its top 2 experts; each of the "
                             f"{self.num_groups} groups needs at least 2 of the {self.num_experts} experts")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok ({self.top_k}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.intermediate_size <= 0:
            raise ValueError(f"config.json: the experts' intermediate size must be positive, got "
                             f"{self.intermediate_size}")
        if self.routing not in MOE_ROUTINGS or self.activation not in MOE_ACTIVATIONS:
            raise ValueError(f"MoE routing {self.routing!r} / activation {self.activation!r}: use one of "
                             f"{list(MOE_ROUTINGS)} / {list(MOE_ACTIVATIONS)}")


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3; `model.deepseek.MlaAttention`).

    Each token caches one row per layer, ``[c | k_rope]`` of ``kv_lora_rank + qk_rope_head_dim`` values: the
    normalised KV latent and the rotated key part every head shares. Keys and values are ``kv_b_proj`` of the
    latent (per head ``qk_nope_head_dim`` + ``v_head_dim`` columns).

    Attributes:
        q_lora_rank: the query's low-rank width (``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj``), or None
            for one ``q_proj``.
        kv_lora_rank: the latent's width.
        qk_nope_head_dim, qk_rope_head_dim: a query/key head's unrotated and rotated parts.
        v_head_dim: a value head's width.
        rope_interleave: rotary pairs are adjacent columns ``(x0, x1), (x2, x3)…`` (DeepSeek's own layout,
            V2 always; V3 unless ``rope_interleave`` is false), not the two halves.
        softmax_scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times yarn's
            ``mscale(factor, mscale_all_dim) ** 2`` when the rope is scaled (transformers' ``yarn_apply_mscale``).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"config.json: q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.json: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def latent_width(self) -> int:
        """Values one token caches per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. Build it with `ModelConfig.from_hf_dict`.

    Attributes:
        qkv_bias: q/k/v projections carry a bias (Qwen2 always; Llama when ``attention_bias``).
        o_bias: the output projection carries a bias (Llama ``attention_bias`` only).
        eos_token_ids: every end-of-sequence id (``eos_token_id`` may be an int or a list).
        sliding_window_tokens: the window of the sliding layers if any layer slides, else None.
        layer_types: per layer, ``full_attention`` or ``sliding_attention`` (empty: every layer full).
        qk_norm: per-head RMSNorm of q and k (over ``head_dim``) before rotary (Qwen3).
        attention_sinks: one learned logit per query head in every softmax (gpt-oss ``sinks``).
        norm_scale_in_float32: RMSNorm multiplies by its weight in float32 before casting back
            (gpt-oss keeps its norms in float32); otherwise it casts, then multiplies (Llama).
        moe: the mixture-of-experts MLP, or None for a dense SwiGLU MLP on every layer.
        mla: multi-head latent attention (DeepSeek), or None for GQA. With MLA, ``head_dim`` is the rotary
            width ``qk_rope_head_dim`` and ``num_key_value_heads`` equals ``num_attention_heads``, as
            transformers sets them; the KV cache holds `kv_planes` instead.
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
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False
    attention_sinks: bool = False
    norm_scale_in_float32: bool = False
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None

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
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"config.json: layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
            if unknown:
                raise ValueError(f"config.json: layer_types {unknown} are not supported; use "
                                 f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window_tokens:
                raise ValueError("config.json: layer_types names sliding layers but sliding_window is not set")
        if self.sliding_window_tokens is not None and self.sliding_window_tokens <= 0:
            raise ValueError(f"config.json: sliding_window must be positive, got {self.sliding_window_tokens}")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_hidden_layers:
            raise ValueError("MoeConfig.sparse_layers must name every layer")

    @property
    def max_context_tokens(self) -> int:
        """Longest sequence served: ``max_position_embeddings`` (sliding layers attend over their window)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window_tokens
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """`layer_window` of every layer, in order."""
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

    @property
    def kv_planes(self) -> tuple[int, int, int]:
        """What one layer caches per token, as ``(planes, heads, width)`` (`kvstore.block_spec.BlockSpec`):
        ``(2, num_key_value_heads, head_dim)`` for K and V heads; ``(1, 1, kv_lora_rank + qk_rope_head_dim)``
        for MLA's one latent row."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_width
        return 2, self.num_key_value_heads, self.head_dim

    @property
    def long_context_refusal(self) -> str | None:
        """Why H2O and InfiniGen cannot run on this model, or None: they keep a subset of rows whose row index
        is no longer the token's position (a window mask needs it), and their per-token weights do not count
        a sink."""
        if self.sliding_window_tokens is not None:
            return f"a model with sliding-window layers ({self.model_type})"
        if self.attention_sinks:
            return f"a model with attention sinks ({self.model_type})"
        if self.mla is not None:
            return f"a model with multi-head latent attention ({self.model_type}): its cache holds latents, not keys"
        return None

    @property
    def kv_groups(self) -> tuple[KvGroup, ...]:
        """How the layers' KV is paged (`kvstore.block_spec`): one block of a sequence holds one group's
        layers for 16 tokens, so a sliding group's blocks that fell out of its window can be freed while
        the full group keeps its own (vLLM's hybrid KV cache manager, with groups of equal layer count so
        that every block has one size).

        * every layer full, or every layer sliding with one window: one group of all layers;
        * as many full as sliding layers (gpt-oss): two groups, the full layers first (group 0: its block
          keys are the plain prefix keys the router indexes), then the sliding ones;
        * any other mix (Qwen2 with ``max_window_layers``): one group of all layers, never freed early
          (each layer still attends over its own window).
        """
        windows = self.layer_windows
        layers = tuple(range(self.num_hidden_layers))
        if len(set(windows)) == 1:
            return (KvGroup(layers, windows[0]),)
        full = tuple(i for i in layers if windows[i] is None)
        sliding = tuple(i for i in layers if windows[i] is not None)
        if len(full) == len(sliding) and len({windows[i] for i in sliding}) == 1:
            return (KvGroup(full, None), KvGroup(sliding, windows[sliding[0]]))
        return (KvGroup(layers, None),)

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
        max_positions = int(config.get("max_position_embeddings", 2048))
        rope = _parse_rope(config, max_positions)
        mla = _parse_mla(config, model_type, rope, need) if model_type.startswith("deepseek") else None
        if mla is not None:
            head_dim = mla.qk_rope_head_dim  # the rotary width, as transformers sets head_dim
        num_layers = int(need("num_hidden_layers"))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(config.get("attention_bias", model_type == "gpt_oss"))
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        bos = config.get("bos_token_id")
        window, layer_types = _parse_layer_types(config, model_type, num_layers)
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads if mla is not None else int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope=rope,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_window_tokens=window,
            layer_types=layer_types,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_sinks=model_type == "gpt_oss",
            norm_scale_in_float32=model_type == "gpt_oss",
            moe=_parse_moe(config, model_type, num_layers),
            mla=mla,
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
    if rope_type == "yarn":
        factor = 1.0  # read with the rest of yarn's keys
    elif params.get("factor") is None:
        raise ValueError(f"config.json: rope type {rope_type!r} needs a factor")
    else:
        factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    original_key = "original_max_position_embeddings"
    original = params.get(original_key) or config.get(original_key)
    if rope_type == "yarn":
        return _parse_yarn(params, theta, max_positions, original)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original or max_positions),
    )


def _parse_layer_types(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(window of the sliding layers or None, per-layer types or ``()`` when every layer is full), as each
    family's transformers config derives them."""
    window = config.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window"):
        window = None  # transformers drops the window unless use_sliding_window
    if window is None or model_type == "llama":
        return None, ()
    window = int(window)
    given = config.get("layer_types")
    if model_type in ("mistral", "mixtral", "qwen3_moe"):
        types = [SLIDING_ATTENTION] * num_layers
    elif given is not None:
        types = list(given)
    elif model_type == "gpt_oss":
        types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
    else:  # qwen2, qwen3
        first = int(config.get("max_window_layers", num_layers))
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    if SLIDING_ATTENTION not in types:
        return None, ()
    return window, tuple(types)


def _parse_moe(config: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    if model_type.startswith("deepseek"):
        return _parse_deepseek_moe(config, model_type, num_layers)
    if model_type not in ("qwen3_moe", "mixtral", "gpt_oss"):
        return None
    experts = config.get("num_experts") or config.get("num_local_experts")
    top_k = config.get("num_experts_per_tok")
    if experts is None or top_k is None:
        raise ValueError(f"config.json: a {model_type} model needs num_experts (or num_local_experts) and "
                         f"num_experts_per_tok")
    if model_type == "qwen3_moe":
        step = int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))
        inter = config.get("moe_intermediate_size")
        if inter is None:
            raise ValueError("config.json: required key 'moe_intermediate_size' is missing")
        return MoeConfig(num_experts=int(experts), top_k=int(top_k), intermediate_size=int(inter),
                         routing="softmax_topk", norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                         router_bias=False, expert_bias=False, activation="silu", sparse_layers=sparse)
    inter = int(config["intermediate_size"])
    if model_type == "mixtral":
        return MoeConfig(num_experts=int(experts), top_k=int(top_k), intermediate_size=inter,
                         routing="softmax_topk", norm_topk_prob=True, router_bias=False, expert_bias=False,
                         activation="silu", sparse_layers=(True,) * num_layers)
    return MoeConfig(num_experts=int(experts), top_k=int(top_k), intermediate_size=inter,
                     routing="topk_softmax", norm_topk_prob=False, router_bias=True, expert_bias=True,
                     activation="swiglu_oai", sparse_layers=(True,) * num_layers,
                     swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(config.get("swiglu_limit", 7.0)))


def _parse_yarn(params: dict[str, Any], theta: float, max_positions: int, original: Any) -> RopeConfig:
    """Yarn as ``transformers.modeling_rope_utils._compute_yarn_parameters`` reads it."""
    if original is None:
        raise ValueError("config.json: yarn rope needs original_max_position_embeddings")
    original = int(original)
    factor = params.get("factor")
    factor = max_positions / original if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                      beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                      truncate=bool(params.get("truncate", True)), attention_factor=float(attention))


# transformers' DeepseekV3Config / DeepseekV2Config defaults, for keys a config.json leaves out (published configs
# give them all).
_DEEPSEEK_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
                        norm_topk_prob=True),
    "deepseek_v2": dict(n_routed_experts=64, num_experts_per_tok=None, moe_intermediate_size=1407, n_shared_experts=2,
                        n_group=None, topk_group=None, routed_scaling_factor=1.0, first_k_dense_replace=0,
                        topk_method="greedy"),
}


def _parse_deepseek_moe(config: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """DeepSeek's experts as transformers reads them (its config defaults for absent keys): the layers from
    ``first_k_dense_replace`` on are MoE (the published checkpoints' ``moe_layer_freq`` is 1, and transformers
    does not read it); none when ``n_routed_experts`` is null or 0."""
    defaults = _DEEPSEEK_MOE_DEFAULTS[model_type]

    def get(key: str) -> Any:
        return config[key] if key in config else defaults.get(key)

    experts = config.get("num_local_experts") or get("n_routed_experts")
    if not experts:
        return None
    first_dense = int(get("first_k_dense_replace") or 0)
    sparse = tuple(i >= first_dense for i in range(num_layers))
    inter, top_k = get("moe_intermediate_size"), get("num_experts_per_tok")
    if inter is None or top_k is None:
        raise ValueError(f"config.json: a {model_type} model with experts needs moe_intermediate_size and "
                         f"num_experts_per_tok")
    shared = int(get("n_shared_experts") or 0)
    if model_type == "deepseek_v3":
        routing, norm, bias = "sigmoid_group_topk", bool(get("norm_topk_prob")), True
        groups, topk_group = int(get("n_group") or 1), int(get("topk_group") or 1)
    else:
        method = get("topk_method")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"config.json: topk_method {method!r} is not supported for {model_type}; use "
                             f"'greedy' or 'group_limited_greedy'")
        routing, norm, bias = "softmax_group_topk", False, False  # transformers' V2 does not renormalise
        limited = method == "group_limited_greedy"
        groups = int(get("n_group") or 1) if limited else 1
        topk_group = int(get("topk_group") or 1) if limited else 1
    return MoeConfig(num_experts=int(experts), top_k=int(top_k), intermediate_size=int(inter), routing=routing,
                     norm_topk_prob=norm, router_bias=False, expert_bias=False, activation="silu",
                     sparse_layers=sparse, num_groups=groups, topk_group=topk_group,
                     routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
                     shared_intermediate_size=int(inter) * shared, score_correction_bias=bias)


def _parse_mla(config: dict[str, Any], model_type: str, rope: RopeConfig, need: Any) -> MlaConfig:
    """DeepSeek's attention shape; the softmax scale as transformers' ``yarn_apply_mscale``."""
    nope, rot = int(need("qk_nope_head_dim")), int(need("qk_rope_head_dim"))
    scale = (nope + rot) ** -0.5
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    m_all = params.get("mscale_all_dim")
    if rope.rope_type != "default" and m_all:
        factor = rope.factor  # yarn without a factor: derived from the context lengths (`_parse_yarn`)
        mscale = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= mscale * mscale
    q_rank = config.get("q_lora_rank")
    return MlaConfig(q_lora_rank=None if q_rank is None else int(q_rank), kv_lora_rank=int(need("kv_lora_rank")),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=int(need("v_head_dim")),
                     rope_interleave=model_type == "deepseek_v2" or bool(config.get("rope_interleave", True)),
                     softmax_scale=scale)
