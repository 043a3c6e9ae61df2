"""``kvrelay bench deterministic`` on the tiny model: both modes' rates, the ratios, the default plan it ran beside."""

from __future__ import annotations

from kvrelay.benchmarks.deterministic_bench import BATCHES, run
from kvrelay.model.cpu_identity import this_cpu


def test_the_bench_compares_deterministic_mode_with_the_default(tiny_model_dir) -> None:
    result = run(model_dir=str(tiny_model_dir), prompt_len=16, max_out=3, prefill_len=100, rounds=1,
                 dtype="bfloat16")
    assert result["cpu"] == this_cpu().kernel_label and result["default_plan"]["deterministic"] is False
    for batch in BATCHES:
        row = result[f"batch_{batch}"]
        assert set(row) == {"default_tok_per_s", "deterministic_tok_per_s", "deterministic_vs_default"}
        ratio = row["deterministic_tok_per_s"] / row["default_tok_per_s"]  # of the rounded rates: within rounding
        assert abs(row["deterministic_vs_default"] - ratio) <= 0.02 * ratio
    prefill = result["prefill"]
    assert set(prefill) == {"default_s", "deterministic_s", "deterministic_vs_default"}
    assert abs(prefill["deterministic_vs_default"] - prefill["deterministic_s"] / prefill["default_s"]) <= 0.02 * (
        prefill["deterministic_s"] / prefill["default_s"]) + 1e-3
    # the deterministic plan keeps only the blocked copies: no more than the default's
    assert result["weight_bytes"]["deterministic"] <= result["weight_bytes"]["default"]
