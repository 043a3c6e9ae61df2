"""`write_tiny_model`: a small deterministic random-weight Llama in Hugging Face format.

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
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
BOS_ID, EOS_ID = 256, 257
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
) -> Path:
    """Write the model files into ``out_dir`` (created if needed) and return it as a Path.

    Files: ``config.json`` (classic form, ``model_type: llama``), ``model.safetensors`` (``dtype``),
    ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (with a plain-text chat
    template ``<|role|>\\ncontent\\n``), ``special_tokens_map.json``. ``intermediate`` defaults to
    ``2 * hidden``; ``head_dim`` is ``hidden // heads``. ``dtype`` (``float32`` | ``bfloat16`` | ``float16``):
    the stored weights' dtype (drawn in float32, then cast: a model with a real model's shapes, e.g.
    Llama-3.1-8B's, for GPU checks).

    Raises:
        ValueError: ``vocab < 258``, or ``hidden`` / ``heads`` / ``kv_heads`` do not divide.
    """
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
    byte_to_char = _bytes_to_unicode()
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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _random_weights(config: dict[str, Any], seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named tensors of ``dtype``, drawn in float32 in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype).contiguous()

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=in_features**-0.5)

    def norm() -> torch.Tensor:
        return 1.0 + normal(hidden, std=0.1)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "self_attn.q_proj.weight"] = linear(q_size, hidden) * 2.0  # sharper attention
        weights[p + "self_attn.k_proj.weight"] = linear(kv_size, hidden) * 2.0
        weights[p + "self_attn.v_proj.weight"] = linear(kv_size, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        weights[p + "post_attention_layernorm.weight"] = norm()
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm()
    weights["lm_head.weight"] = linear(config["vocab_size"], hidden) * 4.0  # peaked next-token distribution
    return dict(sorted(weights.items()))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
