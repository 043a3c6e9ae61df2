"""``kvrelay bench kernel-plan`` on the tiny model: each plan's copies of the weights, its ratios, the plan it
measured."""

from __future__ import annotations

from kvrelay.benchmarks.kernel_plan_bench import BATCHES, run
from kvrelay.model.cpu_identity import this_cpu


def test_the_bench_compares_the_measured_plan_with_both_fixed_rules(tiny_model_dir) -> None:
    result = run(model_dir=str(tiny_model_dir), prompt_len=16, max_out=3, rounds=1, dtype="bfloat16")
    assert result["cpu"] == this_cpu().kernel_label and result["plan"]["source"] == "measured"
    for batch in BATCHES:
        row = result[f"batch_{batch}"]
        assert set(row) == {"measured_tok_per_s", "builtin_tok_per_s", "torch_tok_per_s", "measured_vs_builtin",
                            "measured_vs_torch"}
        for other in ("builtin", "torch"):  # the ratio of the unrounded rates: within the rounding of the rates
            ratio = row["measured_tok_per_s"] / row[f"{other}_tok_per_s"]
            assert abs(row[f"measured_vs_{other}"] - ratio) <= 0.02 * ratio
    weights = result["weight_bytes"]
    # the torch-only plan keeps no blocked copy; the builtin rule keeps every copy; the measured one no more
    assert weights["torch"] < weights["builtin"] and weights["measured"] <= weights["builtin"]
