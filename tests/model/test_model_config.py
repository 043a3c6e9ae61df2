"""`ModelConfig.from_hf_dict`: both rope forms, the supported families and the error messages."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from kvrelay.model.config import ModelConfig, RopeConfig, read_model_config
from transformers import LlamaConfig, MistralConfig, Qwen2Config

LLAMA31_CLASSIC = {  # the shape of meta-llama/Llama-3.1-8B-Instruct's config.json, shrunk
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 256, "intermediate_size": 512, "max_position_embeddings": 131072,
    "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
LLAMA31_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_classic_llama31_config() -> None:
    c = ModelConfig.from_hf_dict(LLAMA31_CLASSIC)
    assert c.rope == LLAMA31_ROPE
    assert (c.head_dim, c.num_key_value_heads, c.qkv_bias, c.o_bias) == (32, 2, False, False)
    assert (c.bos_token_id, c.eos_token_ids) == (128000, (128001, 128008, 128009))
    assert c.sliding_window_tokens is None and c.max_context_tokens == 131072


def test_rope_parameters_form_written_by_transformers_parses_the_same() -> None:
    written = LlamaConfig(**LLAMA31_CLASSIC).to_dict()
    assert "rope_parameters" in written and written["rope_parameters"]["rope_theta"] == 500000.0
    assert "rope_scaling" not in written and "rope_theta" not in written
    assert ModelConfig.from_hf_dict(written) == ModelConfig.from_hf_dict(LLAMA31_CLASSIC)


def test_llama2_linear_scaling_with_legacy_type_key() -> None:
    c = ModelConfig.from_hf_dict({**LLAMA31_CLASSIC, "rope_theta": 10000.0,
                                  "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert c.rope == RopeConfig(theta=10000.0, rope_type="linear", factor=4.0)


def test_no_rope_settings_means_default_theta() -> None:
    raw = {k: v for k, v in LLAMA31_CLASSIC.items() if k not in ("rope_scaling", "rope_theta")}
    assert ModelConfig.from_hf_dict(raw).rope == RopeConfig(theta=10000.0, rope_type="default")


def test_llama3_original_max_positions_defaults_to_max_position_embeddings() -> None:
    scaling = {k: v for k, v in LLAMA31_CLASSIC["rope_scaling"].items() if k != "original_max_position_embeddings"}
    c = ModelConfig.from_hf_dict({**LLAMA31_CLASSIC, "rope_scaling": scaling})
    assert c.rope.original_max_position_embeddings == 131072


def test_explicit_head_dim_differs_from_hidden_over_heads() -> None:
    c = ModelConfig.from_hf_dict({**LLAMA31_CLASSIC, "head_dim": 48})
    assert c.head_dim == 48 and c.hidden_size // c.num_attention_heads == 32


def test_llama_attention_bias_sets_all_four_projections() -> None:
    c = ModelConfig.from_hf_dict({**LLAMA31_CLASSIC, "attention_bias": True})
    assert (c.qkv_bias, c.o_bias) == (True, True)


def test_qwen2_classic_config_has_qkv_bias_and_no_window() -> None:
    raw = {  # Qwen2.5-style: a window is named but not used
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "vocab_size": 500,
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 21, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    }
    c = ModelConfig.from_hf_dict(raw)
    assert (c.qkv_bias, c.o_bias, c.tie_word_embeddings) == (True, False, True)
    assert c.sliding_window_tokens is None and c.rope == RopeConfig(theta=1000000.0)
    assert ModelConfig.from_hf_dict(Qwen2Config(**raw).to_dict()) == c
    windowed = ModelConfig.from_hf_dict({**raw, "use_sliding_window": True, "max_window_layers": 1})
    assert windowed.sliding_window_tokens == 32768


def test_mistral_sliding_window_slides_every_layer_and_no_longer_caps_the_context() -> None:
    raw = MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                        num_hidden_layers=2, vocab_size=100, max_position_embeddings=32768,
                        sliding_window=4096).to_dict()
    c = ModelConfig.from_hf_dict(raw)
    assert (c.sliding_window_tokens, c.max_context_tokens, c.layer_windows) == (4096, 32768, (4096, 4096))
    plain = ModelConfig.from_hf_dict({**raw, "sliding_window": None})
    assert plain.layer_windows == (None, None) and plain.layer_types == ()


def test_unknown_model_type_lists_supported_ones() -> None:
    expected = (r"model_type 'gemma2'.*supported model types: \['llama', 'mistral', 'qwen2', 'qwen3', "
                r"'qwen3_moe', 'mixtral', 'gpt_oss', 'deepseek_v3', 'deepseek_v2'\]")
    with pytest.raises(ValueError, match=expected):
        ModelConfig.from_hf_dict({**LLAMA31_CLASSIC, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]})


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    raw = {**LLAMA31_CLASSIC, "rope_scaling": {"rope_type": rope_type, "factor": 2.0}}
    expected = rf"rope type '{rope_type}' is not supported.*'default', 'linear', 'llama3', 'yarn'"
    with pytest.raises(ValueError, match=expected):
        ModelConfig.from_hf_dict(raw)


def test_unsupported_activation_and_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_hf_dict({**LLAMA31_CLASSIC, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"num_attention_heads \(8\) must be a multiple of num_key_value_heads \(3\)"):
        ModelConfig.from_hf_dict({**LLAMA31_CLASSIC, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="required key 'vocab_size' is missing"):
        ModelConfig.from_hf_dict({k: v for k, v in LLAMA31_CLASSIC.items() if k != "vocab_size"})


def test_config_is_frozen() -> None:
    c = ModelConfig.from_hf_dict(LLAMA31_CLASSIC)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 3  # type: ignore[misc]


def test_read_model_config_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}/config.json not found"):
        read_model_config(tmp_path)
