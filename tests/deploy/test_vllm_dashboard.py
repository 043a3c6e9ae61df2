"""Issue 64: vLLM's own Grafana dashboard shows a kvrelay deployment.

vLLM's dashboard (``examples/observability/prometheus_grafana/grafana.json`` in vllm-project/vllm, at
`VLLM_DASHBOARD_COMMIT`) has 27 PromQL queries over 21 series, every one filtered on ``model_name="$model_name"``
(a template variable: ``label_values(model_name)``). `VLLM_DASHBOARD_SELECTS` lists what those queries select,
series by series with the labels each filters or groups on, as `dashboard_selects` read them from that file (not
shipped here: it is vLLM's to publish; a user loads it into Grafana as it is).

A real deployment (``kvrelay up`` on the tiny model: a router, a prefill node, a decode node) serves one request;
then every service's ``/metrics`` is read, and each selected series must be there with those labels and
``model_name`` set to the served model's name; each vLLM family is exported by one kind of service only (the
router or the engine nodes: `node.vllm_metrics`), so that a Prometheus scraping them all counts each thing once.
"""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.test_dashboard import metric_names, selector_labels
from tests.services.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
VLLM_DASHBOARD_COMMIT = "4b5c627c23e6690b8987100d1cbf78e34ac14bf9"
MODEL = "tiny"  # the served model name (tests.services.cluster)

M, LE = frozenset({"model_name"}), frozenset({"model_name", "le"})
VLLM_DASHBOARD_SELECTS: dict[str, frozenset[str]] = {
    # E2E Request Latency, Inter Token Latency, Time To First Token: p50/p90/p95/p99 and the mean
    **{f"vllm:{h}_{part}": LE if part == "bucket" else M
       for h in ("e2e_request_latency_seconds", "inter_token_latency_seconds", "time_to_first_token_seconds")
       for part in ("bucket", "sum", "count")},
    "vllm:prompt_tokens_total": M, "vllm:generation_tokens_total": M,  # Token Throughput
    "vllm:num_requests_running": M, "vllm:num_requests_waiting": M,  # Scheduler State
    "vllm:kv_cache_usage_perc": M,  # Cache Utilization
    "vllm:request_prompt_tokens_bucket": LE, "vllm:request_generation_tokens_bucket": LE,  # the two heatmaps
    "vllm:request_success_total": frozenset({"model_name", "finished_reason"}),  # Finish Reason
    "vllm:request_queue_time_seconds_sum": M,  # Queue Time
    "vllm:request_prefill_time_seconds_sum": M, "vllm:request_decode_time_seconds_sum": M,  # Prefill and Decode Time
    "vllm:request_max_num_generation_tokens_sum": M,  # Max Generation Token in Sequence Group
}
ROUTER_FAMILIES = frozenset({
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_success_total", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_max_tokens", "vllm:request_params_n",
    "vllm:request_max_num_generation_tokens"})
NODE_FAMILIES = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:iteration_tokens_total"})
# vLLM's buckets (vllm/v1/metrics/loggers.py), written out here as the spec
TTFT_LE = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5", "5.0",
           "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf")
ITL_LE = ("0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5", "5.0",
          "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf")
REQUEST_LATENCY_LE = ("0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0",
                      "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf")
ITERATION_LE = ("1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "4096.0",
                "8192.0", "16384.0", "+Inf")
PROMPT = list(range(3, 40))  # 37 tokens
MAX_TOKENS = 4
SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)\s*$")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Scrape:
    """One service's ``/metrics``: its vLLM families (``# TYPE`` names: a counter's with ``_total``) and samples."""

    families: frozenset[str]
    samples: tuple[Sample, ...]

    def value(self, name: str, **labels: str) -> float:
        """The one sample named ``name`` whose labels include ``labels``. Raises KeyError if not exactly one."""
        found = [s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items()]
        if len(found) != 1:
            raise KeyError(f"{len(found)} samples of {name}{labels}")
        return found[0]

    def les(self, name: str) -> tuple[str, ...]:
        return tuple(s.labels["le"] for s in self.samples if s.name == name + "_bucket")


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    families, samples = set(), []
    for line in text.splitlines():
        if line.startswith("# TYPE vllm:"):
            name = line.split(" ")[2]
            if not name.endswith("_created"):  # prometheus_client's creation-time series of a counter or histogram
                families.add(name)
        elif line.startswith("vllm:"):
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            labels = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            samples.append(Sample(m.group(1), labels, float(m.group(3))))
    return Scrape(frozenset(families), tuple(samples))


@dataclass(frozen=True)
class Deployment:
    router: Scrape
    prefill: Scrape
    decode: Scrape
    max_model_len: int


@pytest.fixture(scope="module")
def deployment(tiny_model_dir: Path) -> Deployment:
    """Every service's vLLM metrics after one completion (37 prompt tokens, 4 output tokens, n=1)."""
    with Cluster(tiny_model_dir) as c:
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == MAX_TOKENS
        with urllib.request.urlopen(c.url + "/v1/models", timeout=10) as resp:
            max_model_len = json.loads(resp.read())["data"][0]["max_model_len"]
        return Deployment(scrape(c.url), scrape(c.prefill_urls[0]), scrape(c.decode_urls[0]), max_model_len)


def dashboard_selects(board: dict) -> dict[str, frozenset[str]]:
    """``{series: labels}`` every query of a Grafana dashboard selects (labels it filters or groups on)."""
    def panels(items: list[dict]) -> list[dict]:
        return [p for item in items for p in (item, *panels(item.get("panels", [])))]

    exprs = [t["expr"] for p in panels(board["panels"]) for t in p.get("targets", []) if "expr" in t]
    out: dict[str, set[str]] = {}
    for expr in exprs:
        for name in metric_names(expr):
            out.setdefault(name, set())
        for name, labels in selector_labels(expr):
            out.setdefault(name, set()).update(labels)
    return {name: frozenset(labels) for name, labels in out.items()}


def test_the_selects_are_read_from_a_dashboard_s_queries() -> None:
    """How `VLLM_DASHBOARD_SELECTS` was read from vLLM's file (not shipped: see the module doc), on a dashboard in
    its shape: nested panels, a histogram quantile grouped by ``le``, a rate filtered on two labels."""
    board = {"panels": [
        {"targets": [{"expr": 'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket'
                              '{model_name="$model_name"}[$__rate_interval])))'}]},
        {"type": "row", "panels": [{"targets": [
            {"expr": 'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}'
                     '[$__rate_interval]))'},
            {"expr": 'vllm:num_requests_running{model_name="$model_name", engine="$engine"}'},
            {"refId": "B"}]}]},
    ]}
    got = dashboard_selects(board)
    assert set(got) == {"vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total",
                        "vllm:num_requests_running"}
    assert got["vllm:num_requests_running"] == frozenset({"model_name", "engine"})
    assert "model_name" in got["vllm:request_success_total"]
    assert "model_name" in got["vllm:e2e_request_latency_seconds_bucket"]


def test_every_series_vllms_dashboard_selects_is_exported_with_its_labels(deployment: Deployment) -> None:
    samples = [s for scrape in (deployment.router, deployment.prefill, deployment.decode) for s in scrape.samples]
    missing = sorted(name for name, labels in VLLM_DASHBOARD_SELECTS.items()
                     if not any(s.name == name and labels <= s.labels.keys() for s in samples))
    assert not missing, f"series vLLM's dashboard selects that no service exports with its labels: {missing}"
    # $model_name = label_values(model_name): one value, the served model's name, on every vLLM series
    assert {s.labels.get("model_name") for s in samples} == {MODEL}
    assert {s.labels.get("engine") for s in samples} == {"0"}


def test_each_vllm_family_is_exported_by_one_kind_of_service(deployment: Deployment) -> None:
    assert deployment.router.families == ROUTER_FAMILIES
    assert deployment.prefill.families == NODE_FAMILIES and deployment.decode.families == NODE_FAMILIES


def test_vllms_buckets(deployment: Deployment) -> None:
    router, node = deployment.router, deployment.decode
    assert router.les("vllm:time_to_first_token_seconds") == TTFT_LE
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        assert router.les(name) == ITL_LE
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_inference_time"):
        assert router.les(f"vllm:{name}_seconds") == REQUEST_LATENCY_LE
    one_two_five = [m * 10 ** e for e in range(8) for m in (1, 2, 5) if m * 10 ** e <= deployment.max_model_len]
    tokens_le = (*(f"{b}.0" for b in one_two_five), "+Inf")
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_max_num_generation_tokens"):
        assert router.les(f"vllm:{name}") == tokens_le
    assert router.les("vllm:request_params_n") == ("1.0", "2.0", "5.0", "10.0", "20.0", "+Inf")
    assert node.les("vllm:iteration_tokens_total") == ITERATION_LE


def test_the_request_is_counted_once(deployment: Deployment) -> None:
    """One request of 37 prompt tokens and 4 output tokens, disaggregated: its first token from the prefill node,
    the other 3 from the decode node."""
    router, prefill, decode = deployment.router, deployment.prefill, deployment.decode
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert router.value(f"vllm:{name}_seconds_count") == 1, name
    assert router.value("vllm:inter_token_latency_seconds_count") == MAX_TOKENS - 1
    assert router.value("vllm:time_per_output_token_seconds_count") == MAX_TOKENS - 1
    assert {r: router.value("vllm:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort", "error")} == {"stop": 0, "length": 1, "abort": 0, "error": 0}
    assert router.value("vllm:request_prompt_tokens_sum") == len(PROMPT)
    assert router.value("vllm:request_generation_tokens_sum") == MAX_TOKENS
    assert router.value("vllm:request_params_max_tokens_sum") == MAX_TOKENS
    assert router.value("vllm:request_params_n_sum") == 1
    assert router.value("vllm:request_max_num_generation_tokens_sum") == MAX_TOKENS
    # summed over every node, as the dashboard's rate(...{model_name=...}) sums its targets
    assert prefill.value("vllm:prompt_tokens_total") == len(PROMPT) and decode.value("vllm:prompt_tokens_total") == 0
    assert prefill.value("vllm:generation_tokens_total") == 1
    assert decode.value("vllm:generation_tokens_total") == MAX_TOKENS - 1
    # the prefill node computed the prompt in one step; nothing else ran there
    assert prefill.value("vllm:iteration_tokens_total_count") == 1
    assert prefill.value("vllm:iteration_tokens_total_sum") == len(PROMPT)
    assert prefill.value("vllm:iteration_tokens_total_bucket", le="32.0") == 0
    assert prefill.value("vllm:iteration_tokens_total_bucket", le="64.0") == 1
