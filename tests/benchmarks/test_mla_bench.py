"""`kvrelay bench mla`: the KV bytes per token it reports come from the block layout the engine builds."""

from __future__ import annotations

from kvrelay.benchmarks import mla_bench


def test_kv_bytes_per_token_of_deepseek_v3_and_gqa_models_of_its_hidden_size():
    got = mla_bench.kv_bytes_per_token()
    layers = 61
    assert got["deepseek_v3_bytes"] == layers * (512 + 64) * 2  # one bf16 latent row per layer
    assert got["gqa_8kv_bytes"] == layers * 2 * 8 * 128 * 2  # K and V, 8 heads of 128
    assert got["mha_bytes"] == layers * 2 * 56 * 128 * 2  # 7168 / 128 = 56 heads, each its own K and V
    assert got["deepseek_vs_gqa"] == round(576 / 2048, 3) == got["latent_ratio_vs_gqa"]
