"""`kvrelay bench kernel`: the FLOP count prefill rows are judged by, and the run without CUDA."""

from __future__ import annotations

from kvrelay.benchmarks import kernel_bench

HEADS = {"num_q_heads": 2, "num_kv_heads": 1, "head_dim": 8}


def test_prefill_flops_count_the_causal_pairs():
    # 4 new tokens, no prefix: queries attend to 1 + 2 + 3 + 4 keys; 4 flops per (pair, q head, dim).
    assert kernel_bench.prefill_flops(1, 0, 4, HEADS) == 4 * 2 * 8 * 10
    # 3 sequences of 2 new tokens after 5 cached: (5 + 1) + (5 + 2) keys each.
    assert kernel_bench.prefill_flops(3, 5, 2, HEADS) == 4 * 2 * 8 * 3 * 13


def test_without_cuda_only_the_reference_is_timed():
    result = kernel_bench.run_kernel_bench(iters=1, reference_iters=1)
    assert result["device"] == "cpu" and "prefill" not in result
    [row] = result["shapes"]
    assert row["reference_ms"] > 0 and row["bytes_moved"] == kernel_bench.decode_bytes(4, 256, kernel_bench.CPU_HEADS)
