"""`write_tiny_model`: a small deterministic random-weight model of each family, in Hugging Face format.

``arch`` picks the family (`TINY_ARCHS`), each written as its published checkpoints are (config keys and
tensor names), so loading one exercises what loading the real model does::

    llama      the plain decoder (the default)
    qwen3      + q/k RMSNorm, head_dim 2·hidden/heads (independent of hidden/heads), tied embeddings
    qwen3-moe  + 8 experts, top 2, norm_topk_prob; layer 0 dense (mlp_only_layers), the others MoE
    mixtral    4 experts, top 2 (per-expert w1/w2/w3 tensors)
    gpt-oss    4 experts, top 2, fused interleaved expert tensors with biases, router bias, attention
               biases and sinks, yarn rope, sliding (window 32) and full layers alternating
    deepseek-v3  multi-head latent attention (q rank 32, KV latent 32 + rope 8 per token, interleaved yarn
               rope with mscale), the first 2 layers dense, then 8 experts in 4 groups (top 2 of the 2 best
               groups, sigmoid scores with a correction bias, scaled by 2.5) plus one shared expert

The directory loads with `model.loader.load_model`, `model.tokenizer.load_tokenizer` and with
transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer``. The tokenizer is byte-level::

    ids 0..255  one token per byte, id == byte value (UTF-8 of the text)
    id 256      <s>   BOS (special)
    id 257      </s>  EOS (special)
    ids 258..   in the embedding table only (vocab > 258); the tokenizer never produces them

Same arguments → byte-identical files. Weights are spread wide enough (embeddings std 1, linear
std 1/sqrt(fan_in), norm and head weights perturbed) that greedy output wanders instead of repeating
one token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from kvrelay.model.tokenizer import byte_level_alphabet
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
BOS_ID, EOS_ID = 256, 257
TINY_ARCHS: tuple[str, ...] = ("llama", "qwen3", "qwen3-moe", "mixtral", "gpt-oss", "deepseek-v3")
TINY_WINDOW = 32  # gpt-oss's sliding window here: short, so test prompts reach past it
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 258,
    intermediate: int | None = None,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    arch: str = "llama",
) -> Path:
    """Write the model files into ``out_dir`` (created if needed) and return it as a Path.

    Files: ``config.json`` (classic form, the ``model_type`` of ``arch``), ``model.safetensors`` (``dtype``),
    ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (with a plain-text chat
    template ``<|role|>\\ncontent\\n``), ``special_tokens_map.json``. ``intermediate`` defaults to
    ``2 * hidden``; ``head_dim`` is ``hidden // heads``. ``dtype`` (``float32`` | ``bfloat16`` | ``float16``):
    the stored weights' dtype (drawn in float32, then cast: a model with a real model's shapes, e.g.
    Llama-3.1-8B's, for GPU checks).

    Raises:
        ValueError: ``vocab < 258``, or ``hidden`` / ``heads`` / ``kv_heads`` do not divide, or an
            unknown ``arch`` (the known ones are named).
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; use one of {list(TINY_ARCHS)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if vocab < 258:
        raise ValueError(f"vocab must be at least 258 (256 bytes + BOS + EOS), got {vocab}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    intermediate = intermediate or 2 * hidden
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    config.update(_arch_config(arch, config))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False})
    save_file(_random_weights(config, seed, getattr(torch, dtype)), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(byte_level_tokenizer().to_str(pretty=True) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(out / "tokenizer_config.json", {
        **special,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    return out


def byte_level_tokenizer() -> Tokenizer:
    """A `tokenizers.Tokenizer` mapping each UTF-8 byte to the id equal to its value, plus BOS/EOS.

    BPE with no merges over the 256 byte symbols of the GPT-2 byte-to-unicode table; ByteLevel
    pre-tokenizer and decoder without prefix space or regex split; a post-processor that prepends
    BOS (``encode(text)`` in both transformers and `model.tokenizer.Tokenizer`).
    """
    byte_to_char = byte_level_alphabet()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS_TOKEN, special=True, normalized=False),
                            AddedToken(EOS_TOKEN, special=True, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    return tok


def _arch_config(arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """The config keys ``arch`` adds to or changes in the Llama ``base``."""
    hidden, heads, layers = base["hidden_size"], base["num_attention_heads"], base["num_hidden_layers"]
    if arch == "llama":
        return {}
    if arch == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 2 * hidden // heads,
                "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": layers}
    if arch == "qwen3-moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": [0], "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": layers}
    if arch == "deepseek-v3":
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_key_value_heads": heads,
                "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "head_dim": 8,
                "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                "n_group": 4, "topk_group": 2, "moe_intermediate_size": hidden // 2, "first_k_dense_replace": 2,
                "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
                "scoring_func": "sigmoid", "moe_layer_freq": 1, "rope_interleave": True,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    if arch == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": None, "router_jitter_noise": 0.0}
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": 4,
            "num_experts_per_tok": 2, "experts_per_token": 2, "attention_bias": True,
            "sliding_window": TINY_WINDOW, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "rope_theta": 150000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 64, "truncate": False}}


def _random_weights(config: dict[str, Any], seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named tensors of ``dtype``, drawn in float32 in a fixed order from one seeded generator (the
    Llama tensors first, in the order they always were, so a Llama model is the same as before)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype).contiguous()

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=in_features**-0.5)

    def norm(size: int = hidden) -> torch.Tensor:
        return 1.0 + normal(size, std=0.1)

    model_type = config["model_type"]
    head_dim = config["head_dim"]
    moe_layers = set()
    if model_type in ("qwen3_moe", "mixtral", "gpt_oss"):
        moe_layers = set(range(config["num_hidden_layers"])) - set(config.get("mlp_only_layers", []))
    if model_type == "deepseek_v3":
        moe_layers = set(range(config["first_k_dense_replace"], config["num_hidden_layers"]))

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        if model_type == "deepseek_v3":
            weights.update(_mla_weights(config, p, linear, norm))
        else:
            weights[p + "self_attn.q_proj.weight"] = linear(q_size, hidden) * 2.0  # sharper attention
            weights[p + "self_attn.k_proj.weight"] = linear(kv_size, hidden) * 2.0
            weights[p + "self_attn.v_proj.weight"] = linear(kv_size, hidden)
            weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        weights[p + "post_attention_layernorm.weight"] = norm()
        if i in moe_layers:
            weights.update(_moe_weights(config, p, normal, linear))
        else:
            weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        if model_type in ("qwen3", "qwen3_moe"):
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if model_type == "gpt_oss":
            for name, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size), ("o_proj", hidden)):
                weights[p + f"self_attn.{name}.bias"] = normal(size, std=0.1)
            weights[p + "self_attn.sinks"] = normal(config["num_attention_heads"], std=1.0)
    weights["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(config["vocab_size"], hidden) * 4.0  # peaked next-token distribution
    return dict(sorted(weights.items()))


def _mla_weights(config: dict[str, Any], prefix: str, linear: Any, norm: Any) -> dict[str, torch.Tensor]:
    """One DeepSeek attention layer's tensors (`model.deepseek.MlaAttention`)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_rank, rank, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    qk, v = config["qk_nope_head_dim"] + rope, config["v_head_dim"]
    p = prefix + "self_attn."
    return {p + "q_a_proj.weight": linear(q_rank, hidden), p + "q_a_layernorm.weight": norm(q_rank),
            p + "q_b_proj.weight": linear(heads * qk, q_rank) * 2.0,  # sharper attention
            p + "kv_a_proj_with_mqa.weight": linear(rank + rope, hidden) * 2.0,
            p + "kv_a_layernorm.weight": norm(rank), p + "kv_b_proj.weight": linear(heads * (qk - rope + v), rank),
            p + "o_proj.weight": linear(hidden, heads * v)}


def _moe_weights(config: dict[str, Any], prefix: str, normal: Any, linear: Any) -> dict[str, torch.Tensor]:
    """One MoE layer's tensors under the family's checkpoint names (see `model.moe`)."""
    hidden, model_type = config["hidden_size"], config["model_type"]
    experts = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    out: dict[str, torch.Tensor] = {}
    if model_type == "gpt_oss":
        p = prefix + "mlp."
        out[p + "router.weight"] = linear(experts, hidden) * 2.0  # varied routing
        out[p + "router.bias"] = normal(experts, std=0.5)
        out[p + "experts.gate_up_proj"] = normal(experts, hidden, 2 * inter, std=2 * hidden**-0.5)  # reach the clamp
        out[p + "experts.gate_up_proj_bias"] = normal(experts, 2 * inter, std=0.1)
        out[p + "experts.down_proj"] = normal(experts, inter, hidden, std=inter**-0.5)
        out[p + "experts.down_proj_bias"] = normal(experts, hidden, std=0.1)
        return out
    if model_type == "mixtral":
        p, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        p, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out[p + "gate.weight"] = linear(experts, hidden) * 2.0
    for e in range(experts):
        out[p + f"experts.{e}.{names[0]}.weight"] = linear(inter, hidden)
        out[p + f"experts.{e}.{names[1]}.weight"] = linear(inter, hidden)
        out[p + f"experts.{e}.{names[2]}.weight"] = linear(hidden, inter)
    if model_type == "deepseek_v3":
        out[p + "gate.e_score_correction_bias"] = normal(experts, std=0.1)
        shared = inter * config["n_shared_experts"]
        for name, shape in (("gate_proj", (shared, hidden)), ("up_proj", (shared, hidden)),
                            ("down_proj", (hidden, shared))):
            out[p + f"shared_experts.{name}.weight"] = linear(*shape)
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
