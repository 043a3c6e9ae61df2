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
    # DeepSeek-V2: a plain q_proj, softmax routing limited to the 2 best of 4 groups, 2 shared experts, yarn with
    # mscale (its softmax scale), rotary through complex pairs (transformers' V2).
    "deepseek_v2_group_limited": ("DeepseekV2Config", dict(
        _COMMON, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 256, "mscale": 0.707,
                         "mscale_all_dim": 0.707})),
    # DeepSeek-V3 with its less common options: no q LoRA, rotary over halves (rope_interleave false), one group.
    "deepseek_v3_halves_one_group": ("DeepseekV3Config", dict(
        _COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, rope_interleave=False)),
    # an odd intermediate width: bf16 rows of odd width are padded before the few-row linear kernel reads them in
    # pairs (kernels/csrc/small_ops.h: blocked_x)
    "llama_odd_intermediate": ("LlamaConfig", dict(
        _COMMON | dict(intermediate_size=161), num_attention_heads=4, num_key_value_heads=2)),
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
