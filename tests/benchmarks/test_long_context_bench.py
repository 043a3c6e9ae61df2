"""`kvrelay bench long-context` end to end on a short context with a small untrained model (fields and bounds;
the figures themselves come from the trained model, see `benchmarks.long_context_task`)."""

from __future__ import annotations

import json

import torch
from kvrelay.benchmarks.long_context_bench import BUDGET_FRACS, run
from kvrelay.benchmarks.long_context_task import VOCAB_SIZE
from kvrelay.benchmarks.long_context_train import LlamaShape, TrainingLlama, export_hf

POLICY_LABELS = ("h2o", "infinigen", "infinigen-speculative")

FIELDS = {"block_size_tokens", "policy", "budget_frac", "device_budget_tokens", "accuracy", "exact", "agreement",
          "attention_mass_kept", "device_kv_bytes_per_seq", "step_time_vs_none", "decode_ms_per_step"}


def test_bench_reports_every_policy_budget_and_block_size(tmp_path):
    torch.manual_seed(0)
    model = TrainingLlama(LlamaShape(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96))
    model_dir = export_hf(model, tmp_path / "model")
    result = run(model_dir=str(model_dir), context_tokens=96, answer_tokens=6, num_examples=2, seed=3,
                 block_sizes=(16, 8), repeats=1, plot=str(tmp_path / "lc.png"))
    json.dumps(result)  # serialisable as emitted
    rows = result["rows"]
    assert [(r["block_size_tokens"], r["policy"], r["budget_frac"]) for r in rows] == [
        (bs, p, f) for bs in (16, 8) for p, f in [("none", 1.0)] + [(p, f) for f in BUDGET_FRACS
                                                                    for p in POLICY_LABELS]]
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["attention_mass_kept"] <= 1.0 + 1e-6
        if r["policy"] == "none":
            assert r["agreement"] == r["attention_mass_kept"] == 1.0
            continue
        bs = r["block_size_tokens"]
        block_bytes = 2 * 2 * 2 * bs * 16 * 4  # k|v · layers · KV heads · tokens · head_dim · float32
        assert r["device_kv_bytes_per_seq"] <= r["device_budget_tokens"] // bs * block_bytes
        assert r["device_kv_vs_none"] < 1.0
        assert len(r["attention_mass_kept_per_layer"]) == 2
    stats = {r["policy"]: r["policy_stats"] for r in rows[1:4]}
    assert stats["h2o"]["evicted_tokens"] > 0 and stats["infinigen"]["offloaded_blocks"] > 0
    assert stats["infinigen"]["recalled_layer_blocks"] > 0 and stats["infinigen"]["recalled_token_rows"] == 0
    assert stats["infinigen-speculative"]["recalled_token_rows"] > 0
    assert stats["infinigen-speculative"]["recalled_layer_blocks"] == 0
    for r in rows[1:4]:
        assert r["recalled_bytes_per_step"] > 0 if r["policy"] != "h2o" else r["recalled_bytes_per_step"] == 0
    for key in ("infinigen_minus_h2o_accuracy", "infinigen_speculative_minus_h2o_accuracy"):
        assert set(result[key]) == {f"block {bs}, budget {f}" for bs in (16, 8) for f in BUDGET_FRACS}
    assert (tmp_path / "lc.png").stat().st_size > 0
