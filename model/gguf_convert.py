"""Convert a Llama-architecture GGUF file into a Hugging Face model directory.

What it writes into ``out_dir`` (which must not exist yet; the caller renames it into place)::

    config.json            LlamaConfig fields from the GGUF's ``llama.*`` metadata
    generation_config.json BOS / EOS / pad ids
    model.safetensors      every tensor de-quantized to float32, then cast to ``dtype``
    tokenizer.json         built with the `tokenizers` library from ``tokenizer.ggml.*`` (see
                           `model.gguf_tokenizer`)
    tokenizer_config.json  special tokens, ``add_bos_token``, ``model_max_length``
    chat_template.jinja    ``tokenizer.chat_template``, when the GGUF has one

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` (it interleaves the two
rotary halves of every head); `unpermute_rows` undoes that, so the weights are those of the
original checkpoint and rotary embeddings apply as in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvrelay.model.dtype import DTYPE_NAME_TO_TORCH
from kvrelay.model.dtype_names import PULL_DTYPES
from kvrelay.model.gguf_tokenizer import GgufError, build_tokenizer, read_field, tokenizer_config
from safetensors.torch import save_file
from tqdm import tqdm

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)
GGUF_LAYER_TO_HF: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped).

    Raises:
        GgufError: the file is not a readable GGUF (truncated, wrong magic, damaged header).
    """
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise GgufError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                        "it may be truncated or damaged: delete it and download it again") from None


def hf_config(reader: Any) -> dict[str, Any]:
    """``config.json`` contents for the GGUF's model.

    Raises:
        GgufError: the architecture is not Llama, or a required ``llama.*`` key is missing.
    """
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GgufError(f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
    heads = int(read_field(reader, "llama.attention.head_count"))
    hidden = int(read_field(reader, "llama.embedding_length"))
    tokens = read_field(reader, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(read_field(reader, "llama.vocab_size", default=len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(read_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(read_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(read_field(reader, "llama.attention.head_count_kv", default=heads)),
        "head_dim": int(read_field(reader, "llama.rope.dimension_count", default=hidden // heads)),
        # float32 in the file: 1e-5 reads back as 9.9999997e-06; 7 digits recover the written value.
        "rms_norm_eps": float(f"{read_field(reader, 'llama.attention.layer_norm_rms_epsilon'):.7g}"),
        "max_position_embeddings": int(read_field(reader, "llama.context_length")),
        "rope_theta": float(f"{read_field(reader, 'llama.rope.freq_base', default=10000.0):.7g}"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
    if read_field(reader, "llama.rope.scaling.type", default=None) not in (None, "none"):
        raise GgufError("GGUF rope scaling is not supported by this converter")
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                      ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        value = read_field(reader, key, default=None)
        if value is not None:
            config[name] = int(value)
    return config


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    The converter stored each head's rows as ``[r0, r_h, r1, r_h+1, ...]`` (the two rotary halves
    interleaved, ``h = head_dim / 2``); this returns ``[r0, r1, ..., r_h, r_h+1, ...]`` per head.
    ``weight``: ``[num_heads * head_dim, in_features]``.
    """
    out_features, in_features = weight.shape
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, half, 2, in_features).transpose(1, 2).reshape(out_features, in_features)


def hf_tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, float32 tensor)`` for every tensor of the GGUF, de-quantized and un-permuted.

    Raises:
        GgufError: a tensor has a name this converter does not know, or cannot be de-quantized.
    """
    from gguf import GGMLQuantizationType, quants

    for t in reader.tensors:
        name = _hf_name(t.name)
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                array = np.asarray(t.data, dtype=np.float32)
            else:
                array = quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise GgufError(f"tensor {t.name!r} ({t.tensor_type.name}) cannot be de-quantized: {exc}") from None
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        tensor = torch.from_numpy(np.array(array, dtype=np.float32, order="C")).reshape(shape)
        if name.endswith("q_proj.weight"):
            tensor = unpermute_rows(tensor, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            tensor = unpermute_rows(tensor, config["num_key_value_heads"])
        yield name, tensor


def _hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_GLOBAL_TO_HF:
        return GGUF_GLOBAL_TO_HF[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in GGUF_LAYER_TO_HF:
        return f"model.layers.{layer}.{GGUF_LAYER_TO_HF[suffix]}"
    raise GgufError(f"GGUF tensor {gguf_name!r} has no Llama counterpart known to this converter")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16",
                 progress: bool = True) -> Path:
    """Write the Hugging Face directory of ``gguf_path`` into ``out_dir`` (see module doc).

    ``out_dir`` is created; it must not exist. On any error it may hold some of the files: the
    caller writes into a scratch directory and renames it only after success.

    Raises:
        GgufError: unreadable file, unsupported architecture, tokenizer or tensor (message names it).
        ValueError: ``dtype`` is not one of `PULL_DTYPES`.
        FileExistsError: ``out_dir`` exists.
    """
    if dtype not in PULL_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(PULL_DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    config = hf_config(reader)
    config["torch_dtype"] = dtype
    tokenizer = build_tokenizer(reader)  # before the slow part: an unsupported tokenizer fails fast
    tok_config = tokenizer_config(reader, model_max_length=config["max_position_embeddings"])
    out_dir.mkdir(parents=True)
    torch_dtype = DTYPE_NAME_TO_TORCH[dtype]
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(hf_tensors(reader, config), total=len(reader.tensors), desc="converting",
                             unit="tensor", disable=not progress):
        tensors[name] = tensor.to(torch_dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    # safetensors writes the weights through a temporary file of mode 0600; give them the mode the other files got
    # (0666 less the umask), so that other users, such as a container's (docs/operations/containers.md), read them.
    (out_dir / "model.safetensors").chmod((out_dir / "config.json").stat().st_mode & 0o777)
    _write_json(out_dir / "generation_config.json", {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    template = read_field(reader, "tokenizer.chat_template", default=None)
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    if template is not None:
        (out_dir / "chat_template.jinja").write_text(template)
    return out_dir


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
