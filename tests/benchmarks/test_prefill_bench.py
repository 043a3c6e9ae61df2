"""Issue 33: `kvrelay bench prefill` — the FLOP count it divides by, and one run on the tiny model."""

from __future__ import annotations

import json

import pytest
from kvrelay.benchmarks.prefill_bench import layer_shapes, main, prefill_flops
from kvrelay.model.config import ModelConfig


def smollm2_like() -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": True})


def test_prefill_flops_count_the_linear_layers_per_token_the_head_once_and_causal_attention():
    cfg = smollm2_like()
    # per token and layer: qkv 576·(576+2·192) + o 576·576 + MLP 3·576·1536 multiply-adds
    per_token = 576 * 960 + 576 * 576 + 3 * 576 * 1536
    flops = prefill_flops(cfg, 2048)
    assert flops["linear"] == 2 * 2048 * per_token * 30 + 2 * 576 * 49152
    # QKᵀ and PV: 2 matmuls · 2 FLOPs · 9 heads · 64 dims · (1 + 2 + … + 2048) keys, per layer
    assert flops["attention"] == 4 * 30 * 9 * 64 * (2048 * 2049 / 2)
    assert flops["total"] == flops["linear"] + flops["attention"]
    # the figures: ~0.4 TFLOP in the linear layers and ~0.13 in attention for a 1,900-token prompt
    f1900 = prefill_flops(cfg, 1900)
    assert f1900["linear"] / 1e12 == pytest.approx(0.395, abs=0.01)
    assert f1900["attention"] / 1e12 == pytest.approx(0.125, abs=0.01)
    # a cached prefix: each new token also sees every cached one
    assert prefill_flops(cfg, 16, cached=100)["attention"] == 4 * 30 * 9 * 64 * (16 * 100 + 16 * 17 / 2)
    assert layer_shapes(cfg) == [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def test_the_bench_runs_on_the_tiny_model_and_reports_utilisation_against_its_own_matmul_rate(
        tiny_model_dir, capsys):
    assert main(["--model", str(tiny_model_dir), "--lengths", "48,96", "--repeats", "1",
                 "--max-num-batched-tokens", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "prefill" and out["max_num_batched_tokens"] == 64 and out["matmul_flop_s"] > 0
    assert sorted(out["lengths"]) == ["48", "96"]
    for n, row in out["lengths"].items():
        assert row["kvrelay_engine_tok_s"] == pytest.approx(int(n) / row["kvrelay_engine_s"])
        assert row["utilisation"] == pytest.approx(row["flops"]["total"] / row["kvrelay_engine_s"]
                                                   / out["matmul_flop_s"])
        assert row["limit_s"] == pytest.approx(row["flops"]["total"] / out["matmul_flop_s"])


def test_the_bench_refuses_a_directory_without_a_model(tmp_path):
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path)])
