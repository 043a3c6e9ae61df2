"""Issues 15 and 64: the metrics vLLM users scrape, under vLLM's names and labels beside ours, move as a run
proceeds, each counted by the one service that has the number (`node.vllm_metrics`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.services.cluster import Cluster, metrics
from tests.services.test_faults import post, wait_for


def vllm(name: str, **extra: str) -> str:
    """The key `metrics` gives a vLLM series: ``name`` with vLLM's labels (the served model name, one engine) and
    ``extra`` ones, in the exposition's order (sorted by name)."""
    labels = sorted({"model_name": "tiny", "engine": "0", **extra}.items())
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def test_vllm_named_metrics_move_as_a_run_proceeds(tiny_model_dir):
    # A decode pool of 24 blocks (16 tokens each) for 6 requests of ~300 tokens: it must preempt. The router
    # reserves room for 16 output tokens each, so it places them all at once and the node preempts.
    with Cluster(tiny_model_dir, overrides={"kvstore": {"device": {"bytes": "192KiB"}},
                                            "router": {"decode_reserve_tokens": 16}}) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        before = {u: metrics(u) for u in (prefill, decode, c.url)}
        assert all(vllm(g) in before[decode] for g in GAUGES) and all(vllm(k) in before[decode] for k in COUNTERS)
        shared = list(range(3, 67))  # 4 blocks every request shares: prefix hits on the prefill node
        body = {"model": "tiny", "max_tokens": 280, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: post(c.url, {**body, "prompt": shared + [100 + i]}), range(6)))
        assert [code for code, _ in results] == [200] * 6

        def settled() -> bool:  # the last stream's end reaches the client before the engine's next gauges
            m = metrics(decode)
            return m[vllm("vllm:num_requests_running")] == 0 and m[vllm("vllm:num_requests_waiting")] == 0

        wait_for(settled, what="decode gauges back to idle")
        after = {u: metrics(u) for u in (prefill, decode, c.url)}

        def grew(url: str, key: str) -> float:
            return after[url][key] - before[url].get(key, 0.0)

        # prompts count where their first token was computed (the prefill node), never again on the decode node
        assert grew(prefill, vllm("vllm:prompt_tokens_total")) == 6 * 65
        assert grew(decode, vllm("vllm:prompt_tokens_total")) == 0
        assert grew(prefill, vllm("vllm:prefix_cache_queries_total")) >= 6 * 65
        assert grew(prefill, vllm("vllm:prefix_cache_hits_total")) >= 5 * 64  # all but the first reuse 4 blocks
        assert grew(prefill, vllm("vllm:generation_tokens_total")) == 6  # the first token of each
        assert grew(decode, vllm("vllm:generation_tokens_total")) == 6 * 279
        assert grew(decode, vllm("vllm:num_preemptions_total")) > 0
        # the router's: per sample, end to end
        assert grew(c.url, vllm("vllm:time_to_first_token_seconds_count")) == 6
        assert grew(c.url, vllm("vllm:e2e_request_latency_seconds_count")) == 6
        assert grew(c.url, vllm("vllm:request_queue_time_seconds_count")) == 6
        assert grew(c.url, vllm("vllm:inter_token_latency_seconds_count")) == 6 * 279  # one per token after the first
        assert grew(c.url, vllm("vllm:time_per_output_token_seconds_count")) == 6 * 279
        assert grew(c.url, vllm("vllm:request_success_total", finished_reason="length")) == 6
        assert grew(c.url, vllm("vllm:request_success_total", finished_reason="stop")) == 0
        assert grew(c.url, vllm("vllm:request_prompt_tokens_sum")) == 6 * 65
        assert grew(c.url, vllm("vllm:request_generation_tokens_sum")) == 6 * 280
        assert grew(c.url, vllm("vllm:request_params_max_tokens_sum")) == 6 * 280
        assert grew(c.url, vllm("vllm:request_params_n_sum")) == 6
        assert after[decode][vllm("vllm:num_requests_running")] == 0
        assert after[decode][vllm("vllm:num_requests_waiting")] == 0
        assert 0.0 <= after[decode][vllm("vllm:kv_cache_usage_perc")] <= 1.0
        assert "preempted cmpl-" in "".join(c.log)  # preemptions are logged too
        code, _ = post(c.url, {**body, "prompt": shared, "max_tokens": 2})
        assert code == 200
