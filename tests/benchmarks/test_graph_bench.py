"""``kvrelay bench cuda-graphs`` on the CPU: the graphed engine (uncaptured static-input steps here) and the
eager one time the same decode steps and give the same tokens."""

from __future__ import annotations

from kvrelay.benchmarks.graph_bench import run


def test_graph_bench_times_both_engines_over_the_same_tokens(tiny_model_dir) -> None:
    result = run(model_dir=str(tiny_model_dir), device="cpu", dtype="float32", context=40, batches=[1, 3], steps=3,
                 rounds=1, seed=0)
    assert all(result[b]["captured"] is False for b in ("batch_1", "batch_3"))
    for batch in ("batch_1", "batch_3"):
        r = result[batch]
        assert r["same_tokens"] is True
        assert r["steps_timed"] == 3
        assert r["replays"] == 2 + 3  # the warm-up's 2 decode steps, then the 3 timed ones
        assert r["eager_step_ms"] > 0 and r["graph_step_ms"] > 0
