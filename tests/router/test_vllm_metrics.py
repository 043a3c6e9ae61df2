"""Issue 64: vLLM's request-level families as the router measures them (`router.vllm_metrics`), on a fake clock."""

from __future__ import annotations

import time

import pytest
from kvrelay.node.tracing import Tracing
from kvrelay.node.vllm_metrics import buckets_1_2_5
from kvrelay.router.request_trace import RequestTrace
from kvrelay.router.vllm_metrics import SampleClock, VllmRequestMetrics, vllm_finish_reason
from prometheus_client import CollectorRegistry

LABELS = {"model_name": "tiny", "engine": "0"}


def test_token_buckets_are_vllms_1_2_5() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(1) == (1,)
    assert buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    with pytest.raises(ValueError):
        buckets_1_2_5(0)


def test_finish_reasons_map_to_vllms() -> None:
    assert [vllm_finish_reason(r) for r in ("stop", "length", "abort", "tool_calls", None)] == [
        "stop", "length", "abort", "stop", "stop"]


def test_one_request_of_two_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrival at 0 s, parsed at 1 s, 0.5 s in the router's queue and 0.25 s in the prefill node's; sample 0 gets
    1 token at 3 s, 2 at 4 s, 1 at 6 s (length); sample 1 gets 2 tokens at 3 s (stop)."""
    now = [0]
    monkeypatch.setattr(time, "time_ns", lambda: now[0])
    registry = CollectorRegistry()
    metrics = VllmRequestMetrics(registry, model_name="tiny", max_model_len=100)
    trace = RequestTrace(Tracing.off(), {}, arrived_ns=0)
    now[0] = 10**9
    (run,) = trace.admitted(["cmpl-1"], prompt_tokens=7)
    run.plan, run.timings["router_queue_s"], run.timings["prefill_queue_s"] = "disaggregated", 0.5, 0.25
    clock = SampleClock(metrics, trace, prompt_of_choice=[0, 0], prompts=[(7, 2, 16)])
    for t_s, index, n in ((3, 0, 1), (3, 1, 2), (4, 0, 2), (6, 0, 1)):
        now[0] = t_s * 10**9
        clock.tokens(index, n)
    clock.finished(["length", "stop"])

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {**LABELS, **labels})

    assert value("vllm:time_to_first_token_seconds_sum") == 3 + 3
    assert value("vllm:e2e_request_latency_seconds_sum") == 6 + 3
    assert value("vllm:request_queue_time_seconds_sum") == 0.75 * 2
    assert value("vllm:request_prefill_time_seconds_sum") == (3 - 1 - 0.75) * 2
    assert value("vllm:request_decode_time_seconds_sum") == 3 + 0
    assert value("vllm:request_inference_time_seconds_sum") == 1.25 + 3 + 1.25
    # sample 0: 0.5 s twice (2 tokens 1 s after the first), then 2 s; sample 1: its second token came with its first
    assert value("vllm:inter_token_latency_seconds_count") == 4 and value("vllm:inter_token_latency_seconds_sum") == 3
    assert value("vllm:time_per_output_token_seconds_sum") == 3
    assert value("vllm:inter_token_latency_seconds_bucket", le="0.01") == 1
    assert value("vllm:inter_token_latency_seconds_bucket", le="0.5") == 3
    assert value("vllm:request_time_per_output_token_seconds_sum") == 1.0 + 0.0
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("vllm:request_prompt_tokens_sum") == 14 and value("vllm:request_generation_tokens_sum") == 6
    assert value("vllm:request_params_max_tokens_sum") == 16 and value("vllm:request_params_n_sum") == 2
    assert value("vllm:request_max_num_generation_tokens_sum") == 4
    assert value("vllm:request_prompt_tokens_bucket", le="5.0") == 0
    assert value("vllm:request_prompt_tokens_bucket", le="10.0") == 2


def test_a_failed_request_counts_its_samples_under_its_reason_only() -> None:
    registry = CollectorRegistry()
    metrics = VllmRequestMetrics(registry, model_name="tiny", max_model_len=100)
    trace = RequestTrace(Tracing.off(), {}, arrived_ns=time.time_ns())
    trace.admitted(["cmpl-1", "cmpl-2"], prompt_tokens=7)
    clock = SampleClock(metrics, trace, prompt_of_choice=[0, 1, 1], prompts=[(3, 1, 16), (4, 2, 16)])
    clock.tokens(0, 1)
    clock.failed("abort")
    assert {r: registry.get_sample_value("vllm:request_success_total", {**LABELS, "finished_reason": r})
            for r in ("stop", "length", "abort", "error")} == {"stop": 0, "length": 0, "abort": 3, "error": 0}
    assert registry.get_sample_value("vllm:time_to_first_token_seconds_count", LABELS) == 0
    assert registry.get_sample_value("vllm:request_prompt_tokens_count", LABELS) == 0
