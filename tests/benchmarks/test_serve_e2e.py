"""One short run of each workload against a real ``kvrelay up`` (default config, 1 prefill + 1 decode):
the result JSON has every field and the measured hit rate lies in [0, ideal]. Plus the CLI against the
same server, the issue-5 TTFT probe, and the transformers baseline on two prompts."""

from __future__ import annotations

import json
import math

import pytest
from kvrelay.benchmarks import workloads
from kvrelay.benchmarks.common import DEFAULT_TRACE, find_trace
from kvrelay.benchmarks.deployment import Deployment
from kvrelay.benchmarks.serve_client import ClientConfig, LoadConfig
from kvrelay.benchmarks.serve_run import ServerNodes, run_workload

VLLM_FIELDS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
] + [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p90", "p99")]
CACHE_FIELDS = ["source", "role", "query_blocks", "hit_blocks", "hit_rate", "ideal_hit_rate", "offline_lru_hit_rate",
                "offline_lru_capacity_blocks", "hit_rate_vs_offline_lru", "block_size_tokens"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvrelay.model.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("bench-model"), max_position_embeddings=1024))


@pytest.fixture(scope="module")
def server(model_dir: str):  # noqa: ANN201
    # The P/D path (every prompt on the prefill node, whose cache counters the bench reads).
    overrides = {"engine": {"max_num_seqs": 16}, "router": {"disaggregation": "always"}}
    with Deployment(model_dir, overrides=overrides) as dep:
        yield dep


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def shipped_trace(**kwargs: object) -> workloads.Workload:
    assert find_trace() == DEFAULT_TRACE  # the repository's copy: no skip, it is always there
    return workloads.trace(**kwargs)  # type: ignore[arg-type]


WORKLOADS = {
    "shared-prefix": lambda: workloads.shared_prefix(groups=2, prompts_per_group=3, system_tokens=96,
                                                     question_tokens=8, output_tokens=4, seed=11),
    "multi-round": lambda: workloads.multi_round(users=2, rounds=3, system_tokens=48, question_tokens=8,
                                                 output_tokens=6, encode=encode, max_prompt_tokens=400, seed=12),
    "trace": lambda: shipped_trace(start=0, num_requests=12, block_tokens=16, time_compression=20.0,
                                   max_prompt_tokens=300, max_output_tokens=4, seed=13),
    "random": lambda: workloads.random_prompts(num_requests=4, input_tokens=40, output_tokens=4, seed=14),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_end_to_end(server: Deployment, name: str):
    workload = WORKLOADS[name]()
    nodes = ServerNodes(tuple(server.prefill_urls), tuple(server.decode_urls), 16)
    run = run_workload(ClientConfig(server.url, server.model_name, timeout_s=60), workload,
                       LoadConfig(request_rate=math.inf if name != "shared-prefix" else 20.0, seed=1, progress=False),
                       nodes=nodes, goodput={"ttft": 5000.0}, sample_interval_s=0.5)
    json.dumps(run)  # serialisable
    for field in VLLM_FIELDS + ["prefix_cache", "kv_transfer_bytes", "hit_rate_timeline", "ttfts_ms", "workload"]:
        assert field in run, field
    assert run["failed"] == 0, run["errors"]
    assert run["completed"] == workload.expected_total
    assert run["total_output_tokens"] == sum(s.max_tokens for s in workload.requests) * (
        3 if name == "multi-round" else 1)
    assert run["request_goodput"] is not None
    cache = run["prefix_cache"]
    for field in CACHE_FIELDS:
        assert field in cache, field
    assert cache["role"] == "prefill"
    assert 0.0 <= cache["hit_rate"]["total"] <= cache["ideal_hit_rate"] + 1e-9
    assert 0.0 <= cache["offline_lru_hit_rate"] <= cache["ideal_hit_rate"] + 1e-9
    assert set(cache["hit_rate"]) == {"device", "host", "disk", "total"}
    assert run["kv_transfer_bytes"] >= 0
    if name == "shared-prefix":
        # 104-token prompts look up 6 blocks, all of the 96-token system prompt; 4 of 6 prompts find them
        assert cache["ideal_hit_rate"] == pytest.approx(4 / 6)
        assert cache["hit_rate"]["total"] > 0


def test_cli_against_url_writes_json_plots_and_table(server: Deployment, tmp_path):
    from kvrelay.benchmarks.serve_bench import main

    out = tmp_path / "out"
    rc = main(["--url", server.url, "--workload", "random", "--num-prompts", "4", "--input-tokens", "32",
               "--output-tokens", "3", "--request-rate", "50", "inf", "--goodput", "ttft:2000", "tpot:500",
               "--out-dir", str(out), "--no-progress", "--sample-interval-s", "0"])
    assert rc == 0
    names = sorted(p.name for p in out.iterdir())
    assert "server-random-rate50.json" in names and "server-random-rateinf.json" in names
    assert {"summary.md", "summary.json", "ttft_cdf_random.png", "throughput_random.png"} <= set(names)
    run = json.loads((out / "server-random-rate50.json").read_text())
    assert run["completed"] == 4 and run["goodput_slo_ms"] == {"ttft": 2000.0, "tpot": 500.0}
    assert "| server | random | 50.0 |" in (out / "summary.md").read_text()


def test_ttft_prefix_probe(server: Deployment):
    from kvrelay.benchmarks.ttft_prefix import measure_ttft_prefix

    res = measure_ttft_prefix(ClientConfig(server.url, server.model_name), prefix_tokens=256, question_tokens=16,
                              repeats=1, seed=5)
    assert res["repeats"] == 1 and len(res["runs"]) == 1
    assert res["median_cold_ttft_ms"] > 0 and res["median_warm_ttft_ms"] > 0
    assert res["warm_over_cold"] == pytest.approx(res["median_warm_ttft_ms"] / res["median_cold_ttft_ms"])
    # the router's plan and stage timings of each request (the server disaggregates always)
    assert res["plans"] == {"disaggregated -> disaggregated": 1}
    assert {"prefill_compute", "kv_pull", "ttft"} <= set(res["runs"][0]["warm_stages_ms"])


def test_transformers_baseline_counts_requested_tokens(model_dir: str):
    from kvrelay.benchmarks.hf_offline import run_transformers

    specs = workloads.random_prompts(num_requests=3, input_tokens=20, output_tokens=3, range_ratio=0.5, seed=2).requests
    res = run_transformers(model_dir, specs, batch_size=2)
    assert res["completed"] == 3 and res["total_output_tokens"] == 9
    assert res["total_input_tokens"] == sum(len(s.prompt_token_ids) for s in specs)
    assert res["output_throughput"] == pytest.approx(9 / res["duration"])
