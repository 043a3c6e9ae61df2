"""Serving metrics from client records, and cache / transfer counters from the servers' ``/metrics``.

`summarize` uses the definitions and JSON field names of ``vllm bench serve``:

* TTFT = first token − send; E2EL = last token − send (the request's ``latency``);
* TPOT = (E2EL − TTFT) / (output_tokens − 1), only for requests with more than one output token;
* ITL = every gap between consecutive streamed chunks, pooled over all requests;
* each statistic as ``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` and ``pP_X_ms`` (numpy percentiles);
* ``request_throughput`` = completed / duration; ``output_throughput`` = output tokens / duration;
  ``total_token_throughput`` = (input + output tokens of completed requests) / duration;
* ``request_goodput`` = completed requests meeting every SLO of ``--goodput ttft:MS tpot:MS e2el:MS``
  (a request with one output token counts TPOT 0) / duration; None without SLOs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from kvrelay.benchmarks.serve_client import RequestRecord

DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)
SLO_NAMES = ("ttft", "tpot", "e2el")
TIERS = ("device", "host", "disk")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` → ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        ValueError: a pair is not ``NAME:MS``, the name is not one of ``SLO_NAMES``, or MS < 0.
    """
    out: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or ms != ms:
            raise ValueError(f"--goodput {pair!r}: use NAME:MILLISECONDS, e.g. ttft:200")
        if name not in SLO_NAMES:
            raise ValueError(f"--goodput {pair!r}: {name!r} is not one of {list(SLO_NAMES)}")
        if ms < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be >= 0 ms")
        out[name] = ms
    return out


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def request_tpot_s(record: RequestRecord) -> float:
    """TPOT of one request in seconds; 0 for one output token or fewer."""
    n = record.num_output_tokens
    return (record.latency_s - record.ttft_s) / (n - 1) if n > 1 else 0.0


def summarize(records: Sequence[RequestRecord], duration_s: float, *, goodput: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | int | None]:
    """The ``vllm bench serve`` summary of one run (see the module docstring for definitions).

    Raises:
        ValueError: ``duration_s`` <= 0.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft_s for r in ok]
    e2els = [r.latency_s for r in ok]
    tpots = [request_tpot_s(r) for r in ok if r.num_output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl_s]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    good = None
    if goodput:
        slo_s = {k: v / 1000.0 for k, v in goodput.items()}
        per_request = {"ttft": lambda r: r.ttft_s, "tpot": request_tpot_s, "e2el": lambda r: r.latency_s}
        good = sum(all(per_request[k](r) <= v for k, v in slo_s.items()) for r in ok) / duration_s
    result: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats(name, values, percentiles))
    return result


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once (half-open intervals [send, last token))."""
    events = sorted([(r.send_time_s, 1) for r in records] + [(r.send_time_s + r.latency_s, -1) for r in records])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


# ------------------------------------------------------------------ server counters
def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus exposition text → ``{'name{labels}': value}`` (comments and blank lines skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def _sum(samples: Mapping[str, float], metric: str, **labels: str) -> float:
    total = 0.0
    for key, value in samples.items():
        name, _, rest = key.partition("{")
        if name != metric:
            continue
        have = dict(_LABEL.findall(rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def _has(samples: Mapping[str, float], metric: str) -> bool:
    return any(key.partition("{")[0] == metric for key in samples)


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """Cumulative prefix-cache and transfer counters of one node at one moment.

    ``query_blocks`` is None when the node exposes no store metrics (the tiered store is not wired):
    hits then come from the engine's ``kvrelay_engine_prefix_hit_tokens_total`` as device-tier blocks.
    """

    tier_to_hit_blocks: dict[str, float]
    query_blocks: float | None
    hit_tokens: float
    computed_tokens: float
    transfer_bytes: float
    tier_to_capacity_blocks: dict[str, float]

    @classmethod
    def from_samples(cls, samples: Mapping[str, float], *, block_size_tokens: int,
                     device_blocks: float = 0.0) -> CacheCounters:
        """Read a node's counters; ``device_blocks`` (from ``/health``) is used when the store has no gauge."""
        hit_tokens = _sum(samples, "kvrelay_engine_prefix_hit_tokens_total")
        if _has(samples, "kvrelay_prefix_cache_queries_total"):
            hits = {t: _sum(samples, "kvrelay_prefix_cache_hits_total", tier=t) for t in TIERS}
            queries: float | None = _sum(samples, "kvrelay_prefix_cache_queries_total")
        else:
            hits = {"device": hit_tokens / block_size_tokens, "host": 0.0, "disk": 0.0}
            queries = None
        capacity = {t: _sum(samples, "kvrelay_kv_blocks", tier=t) for t in TIERS}
        if not capacity["device"]:
            capacity["device"] = device_blocks
        return cls(hits, queries, hit_tokens, _sum(samples, "kvrelay_engine_prefill_tokens_total"),
                   _sum(samples, "kvrelay_kv_transfer_bytes_total"), capacity)


def cache_delta(before: Sequence[CacheCounters], after: Sequence[CacheCounters], *,
                client_query_blocks: int) -> dict[str, object]:
    """Hit rate in blocks per tier over a run, summed over the nodes that prefilled.

    ``client_query_blocks`` (blocks the client's prompts looked up, computed like the engine does) is the
    denominator when the nodes have no store metrics. Returns ``source`` (``store`` or ``engine``),
    ``query_blocks``, ``hit_blocks`` and ``hit_rate`` per tier plus ``total``.
    """
    store = all(a.query_blocks is not None for a in after)
    hit_blocks = {t: sum(a.tier_to_hit_blocks[t] - b.tier_to_hit_blocks[t] for a, b in zip(after, before))
                  for t in TIERS}
    if store:
        queries = sum((a.query_blocks or 0.0) - (b.query_blocks or 0.0) for a, b in zip(after, before))
    else:
        queries = float(client_query_blocks)
    rates = {t: (hit_blocks[t] / queries if queries else 0.0) for t in TIERS}
    rates["total"] = sum(rates[t] for t in TIERS)
    return {"source": "store" if store else "engine", "query_blocks": queries, "hit_blocks": hit_blocks,
            "hit_rate": rates}


def capacity_blocks(counters: Sequence[CacheCounters]) -> int:
    """Total blocks over every tier of the given nodes (the offline LRU's capacity)."""
    return int(sum(sum(c.tier_to_capacity_blocks.values()) for c in counters))


def transfer_bytes_delta(before: Sequence[CacheCounters], after: Sequence[CacheCounters]) -> float:
    return sum(a.transfer_bytes - b.transfer_bytes for a, b in zip(after, before))
