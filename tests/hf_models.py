"""Small Hugging Face checkpoints built with transformers for parity tests (never downloaded)."""

from __future__ import annotations

from pathlib import Path

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               max_position_embeddings=1024, initializer_range=0.25, rms_norm_eps=1e-5)

# name -> (config class name, kwargs). Each covers one family feature the parity tests pin.
HF_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama_gqa4_llama3": ("LlamaConfig", dict(
        _COMMON, num_attention_heads=8, num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2_bias_tied": ("Qwen2Config", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(_COMMON, num_attention_heads=4, num_key_value_heads=1)),
    "mistral_window_40": ("MistralConfig", dict(_COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=40)),
    "llama_head_dim_32": ("LlamaConfig", dict(
        _COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
}


def build_hf_model(name: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Random-init the named config with transformers, save it (safetensors, float32) and return the dir."""
    import torch
    import transformers

    cls_name, kwargs = HF_CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
