"""Rotary frequencies and rotation, bit-for-bit against transformers."""

from __future__ import annotations

import pytest
import torch
from kvrelay.model.config import ModelConfig
from kvrelay.model.rope import RotaryRows, apply_rotary, rope_inv_freq, rotary_cos_sin
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 4096, "truncate": False},  # gpt-oss's
    "yarn_truncated_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
}


def _hf_config(rope_type: str, head_dim: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       num_hidden_layers=1, vocab_size=10, max_position_embeddings=131072,
                       rope_parameters=dict(ROPE_PARAMETERS[rope_type]))


@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMETERS))
def test_inv_freq_equals_transformers(rope_type: str, head_dim: int) -> None:
    hf_config = _hf_config(rope_type, head_dim)
    if rope_type == "default":
        expected, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[rope_type.split("_")[0]](hf_config, torch.device("cpu"))
    ours = ModelConfig.from_hf_dict(hf_config.to_dict())
    got = rope_inv_freq(ours.rope, ours.head_dim)
    assert scaling == ours.rope.attention_factor
    assert (scaling == 1.0) == (not rope_type.startswith("yarn"))
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    assert torch.equal(got, expected)


def test_llama3_scaling_touches_all_three_bands() -> None:
    rope = ModelConfig.from_hf_dict(_hf_config("llama3", 128).to_dict()).rope
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    ratio = plain / rope_inv_freq(rope, 128)
    assert torch.isclose(ratio[0], torch.tensor(1.0))  # high frequency: kept
    assert torch.isclose(ratio[-1], torch.tensor(8.0))  # low frequency: divided by factor
    assert ((ratio > 1.01) & (ratio < 7.99)).any()  # the smoothed band in between


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_transformers(dtype: torch.dtype) -> None:
    hf_config = _hf_config("llama3", 64)
    hf_rope = LlamaRotaryEmbedding(hf_config)
    positions = torch.tensor([0, 1, 5, 17, 4095, 70000])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, 64, generator=gen).to(dtype)
    k = torch.randn(len(positions), 2, 64, generator=gen).to(dtype)
    cos_hf, sin_hf = hf_rope(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)

    ours = ModelConfig.from_hf_dict(hf_config.to_dict())
    cos, sin = rotary_cos_sin(rope_inv_freq(ours.rope, 64), positions, dtype=dtype)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
    assert torch.equal(apply_rotary(q, cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), k_hf[0].transpose(0, 1))


def test_position_zero_is_identity() -> None:
    x = torch.randn(1, 2, 8)
    rope = ModelConfig.from_hf_dict(_hf_config("default", 8).to_dict()).rope
    cos, sin = rotary_cos_sin(rope_inv_freq(rope, 8), torch.tensor([0]), dtype=torch.float32)
    assert torch.equal(apply_rotary(x, cos, sin), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("head_dim", "rope_type"), [(64, "default"), (128, "llama3"), (32, "yarn_truncated_mscale")])
def test_rotary_rows_hold_each_step_s_own_bits(head_dim: int, rope_type: str, dtype: torch.dtype) -> None:
    """A tabled row is the bits `rotary_cos_sin` gives its position in a step of any size (1 to 16 tokens, in any
    order), before and after the tables grow; rows already there do not move."""
    rope = ModelConfig.from_hf_dict(_hf_config(rope_type, head_dim).to_dict()).rope
    inv_freq, scaling = rope_inv_freq(rope, head_dim), rope.attention_factor
    table = RotaryRows(inv_freq, dtype=dtype, scaling=scaling)
    assert table.tabled and table.cos.shape == (0, head_dim)
    gen = torch.Generator().manual_seed(0)
    first = None
    for limit in (100, 3000, 70000):  # each limit grows the tables
        for t in range(1, 17):
            positions = torch.randint(0, limit, (t,), generator=gen).tolist()
            cos, sin, rows = table.rows(positions)
            assert rows == positions and cos.shape[0] > max(positions)
            want_cos, want_sin = rotary_cos_sin(inv_freq, torch.tensor(positions), dtype=dtype, scaling=scaling)
            assert torch.equal(cos[rows], want_cos) and torch.equal(sin[rows], want_sin)
        if first is None:
            first = table.cos[:100].clone()
    assert table.cos.shape[0] >= 70000 and torch.equal(table.cos[:100], first)


def test_rotary_rows_of_a_width_torch_computes_partly_in_scalar_code_are_each_step_s_own() -> None:
    """At a head dim that is no multiple of 32 nothing is tabled: `RotaryRows.rows` computes the step's rows."""
    inv_freq = rope_inv_freq(ModelConfig.from_hf_dict(_hf_config("default", 24).to_dict()).rope, 24)
    table = RotaryRows(inv_freq, dtype=torch.bfloat16)
    assert not table.tabled
    cos, sin, rows = table.rows([7, 3, 500])
    want_cos, want_sin = rotary_cos_sin(inv_freq, torch.tensor([7, 3, 500]), dtype=torch.bfloat16)
    assert rows == [0, 1, 2] and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert table.cos.shape[0] == 0
