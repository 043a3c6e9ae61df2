"""vLLM's metric families, under vLLM's names, labels and buckets, so that vLLM's Grafana dashboard reads kvrelay.

vLLM (0.32, ``vllm/v1/metrics/loggers.py``) labels every family ``model_name`` (the served model name) and
``engine`` (the engine-core index); kvrelay runs one engine per process, so ``engine`` is always ``"0"`` and the
process is told apart by the ``instance`` label Prometheus adds. Each number is exported by the one service that
has it, so that summing over a deployment's targets counts each thing once:

    engine node (this module, `VllmNodeMetrics`)       router (`router.vllm_metrics`)
    ──────────────────────────────────────────────     ────────────────────────────────────────────
    vllm:num_requests_running / _waiting  (gauge)      vllm:time_to_first_token_seconds
    vllm:kv_cache_usage_perc              (gauge)      vllm:inter_token_latency_seconds
    vllm:num_preemptions_total                         vllm:time_per_output_token_seconds (old name)
    vllm:prefix_cache_queries_total / _hits_total      vllm:request_time_per_output_token_seconds
    vllm:prompt_tokens_total   (the node that          vllm:e2e_request_latency_seconds
        computed the request's first token)            vllm:request_queue_time_seconds / _prefill_ /
    vllm:generation_tokens_total (where generated)         _decode_ / _inference_time_seconds
    vllm:iteration_tokens_total  (histogram)           vllm:request_success_total{finished_reason}
                                                       vllm:request_prompt_tokens / _generation_tokens
                                                       vllm:request_params_max_tokens / _params_n
                                                       vllm:request_max_num_generation_tokens

Request-level families live at the router because only it sees a request end to end (a disaggregated request's
first token comes from a prefill node, the rest from a decode node).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvrelay.engine.token_histogram import TokenHistogram
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

LABELS = ("model_name", "engine")
ENGINE = "0"  # one engine per kvrelay process


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (≥ 1).

    >>> buckets_1_2_5(100)
    (1, 2, 5, 10, 20, 50, 100)
    """
    if max_value < 1:
        raise ValueError(f"max_value must be ≥ 1, got {max_value}")
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _IterationTokens(Collector):
    """``vllm:iteration_tokens_total``: a `TokenHistogram` the engine thread fills, read at each scrape."""

    def __init__(self, steps: TokenHistogram, model_name: str) -> None:
        self._steps = steps
        self._labels = [model_name, ENGINE]

    def collect(self) -> Iterator[Metric]:
        snap = self._steps.snapshot()
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens computed per engine step (prefill "
                                       "chunk tokens plus one per decode row)", labels=LABELS)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(floatToGoString, snap.bounds), "+Inf"), snap.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(self._labels, buckets, snap.total_tokens)
        yield family


class VllmNodeMetrics:
    """One engine node's vLLM families (see the module docstring), children made at start so that every series
    exists (at 0) before the first request, as vLLM's do. Counters move by `add`; gauges by `set_gauges`."""

    COUNTERS = ("preemptions", "prefix_queries", "prefix_hits", "prompt_tokens", "generation_tokens")

    def __init__(self, registry: CollectorRegistry, *, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name
        r, v = registry, (model_name, ENGINE)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(*v)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*v)

        self.running = gauge("vllm:num_requests_running", "Samples in the engine's running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Samples waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Share of the device KV blocks in use (0-1)")
        self.counters: dict[str, Counter] = {
            "preemptions": counter("vllm:num_preemptions", "Preemptions (a sample's KV dropped, to be recomputed)"),
            "prefix_queries": counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
            "prefix_hits": counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            "prompt_tokens": counter("vllm:prompt_tokens", "Prompt tokens of the requests whose first token this "
                                     "node computed"),
            "generation_tokens": counter("vllm:generation_tokens", "Tokens generated"),
        }

    def watch_steps(self, steps: TokenHistogram) -> None:
        """Export ``steps`` (the engine's per-step token counts) as ``vllm:iteration_tokens_total``. Once per node."""
        self.registry.register(_IterationTokens(steps, self.model_name))

    def set_gauges(self, *, running: int, waiting: int, kv_usage_frac: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage_frac)

    def add(self, increments: Mapping[str, int]) -> None:
        """Move the counters named in ``increments`` (keys of `COUNTERS`) by their values (≥ 0)."""
        for name, value in increments.items():
            self.counters[name].inc(value)
