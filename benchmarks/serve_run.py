"""One measured run: send a workload to a server, read its nodes' counters before, during and after.

The result dict holds the `benchmarks.serve_metrics.summarize` fields plus::

    prefix_cache:  source, role, query_blocks, hit_blocks{tier}, hit_rate{tier,total},
                   ideal_hit_rate, offline_lru_hit_rate, offline_lru_capacity_blocks, hit_rate_vs_offline_lru
    kv_transfer_bytes                  KV bytes decode nodes pulled (prefill → decode) during the run
    hit_rate_timeline: [{t_s, device, host, disk}]   hit rate per tier between samples (trace plots)
    ttfts_ms, start_times_s, errors    per request, for plots and debugging

Counters are read from the nodes that prefill (the prefill nodes, or the decode nodes when there are
none). A server that is not kvrelay (no node list in ``/health``) gets ``prefix_cache: null``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.benchmarks.deployment import get_text
from kvrelay.benchmarks.offline_cache import belady_hit_blocks, ideal_hit_blocks, lru_hit_blocks, policy_hit_blocks
from kvrelay.benchmarks.serve_client import ClientConfig, LoadConfig, run_load
from kvrelay.benchmarks.serve_metrics import (
    TIERS,
    CacheCounters,
    cache_delta,
    capacity_blocks,
    parse_prometheus,
    summarize,
    transfer_bytes_delta,
)
from kvrelay.benchmarks.workloads import Workload
from kvrelay.deploy.config_keys import TOKEN_ENV


@dataclass(frozen=True, slots=True)
class ServerNodes:
    """Node URLs of a kvrelay deployment; both empty for another server."""

    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    block_size_tokens: int = 16

    @property
    def cache_role(self) -> str:
        return "prefill" if self.prefill_urls else "decode"

    @property
    def cache_urls(self) -> tuple[str, ...]:
        return self.prefill_urls or self.decode_urls

    @classmethod
    def discover(cls, url: str, *, block_size_tokens: int = 16) -> ServerNodes:
        """Node URLs from the router's ``/health`` (``nodes: {name: {url}}``); empty when absent."""
        try:
            nodes = json.loads(get_text(url + "/health", token=_token())).get("nodes") or {}
        except (urllib.error.URLError, OSError, ValueError):
            return cls()
        prefill = tuple(n["url"] for k, n in sorted(nodes.items()) if k.startswith("prefill"))
        decode = tuple(n["url"] for k, n in sorted(nodes.items()) if k.startswith("decode"))
        return cls(prefill, decode, block_size_tokens)


def _token() -> str | None:
    """The deployment's internal token from ``$KVRELAY_INTERNAL_TOKEN`` (its ``/health`` is full only with it)."""
    return os.environ.get(TOKEN_ENV) or None


def read_counters(urls: Sequence[str], block_size_tokens: int) -> list[CacheCounters]:
    """`CacheCounters` of each node (``/metrics`` and ``/health``)."""
    out = []
    for url in urls:
        samples = parse_prometheus(get_text(url + "/metrics"))
        device_blocks = float(json.loads(get_text(url + "/health", token=_token())).get("total_blocks", 0))
        out.append(CacheCounters.from_samples(samples, block_size_tokens=block_size_tokens,
                                              device_blocks=device_blocks))
    return out


def _window_rates(prev: list[CacheCounters], cur: list[CacheCounters]) -> dict[str, float | None]:
    """Hit rate per tier between two samples; None where nothing was looked up."""
    hits = {t: sum(c.tier_to_hit_blocks[t] - p.tier_to_hit_blocks[t] for c, p in zip(cur, prev)) for t in TIERS}
    if all(c.query_blocks is not None for c in cur):
        queries = sum((c.query_blocks or 0.0) - (p.query_blocks or 0.0) for c, p in zip(cur, prev))
    else:  # engine counters: tokens served from cache over prompt tokens that reached the engine
        hit_tok = sum(c.hit_tokens - p.hit_tokens for c, p in zip(cur, prev))
        queries = hit_tok + sum(c.computed_tokens - p.computed_tokens for c, p in zip(cur, prev))
        hits = {"device": hit_tok, "host": 0.0, "disk": 0.0}
    return {t: (hits[t] / queries if queries > 0 else None) for t in TIERS}


async def _sample(nodes: ServerNodes, interval_s: float, stop: asyncio.Event,
                  timeline: list[dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    prev = await asyncio.to_thread(read_counters, nodes.cache_urls, nodes.block_size_tokens)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
        cur = await asyncio.to_thread(read_counters, nodes.cache_urls, nodes.block_size_tokens)
        timeline.append({"t_s": round(time.perf_counter() - t0, 3), **_window_rates(prev, cur)})
        prev = cur


def run_workload(client: ClientConfig, workload: Workload, load: LoadConfig, *, nodes: ServerNodes,
                 goodput: dict[str, float] | None = None, sample_interval_s: float = 0.0) -> dict[str, Any]:
    """Send ``workload`` and return the run's result dict (see the module docstring).

    ``sample_interval_s`` > 0 records ``hit_rate_timeline`` by polling the nodes while the load runs.
    """
    measured = bool(nodes.cache_urls)
    before = read_counters(nodes.cache_urls, nodes.block_size_tokens) if measured else []
    decode_before = read_counters(nodes.decode_urls, nodes.block_size_tokens) if measured else []
    timeline: list[dict[str, Any]] = []

    async def go() -> Any:
        stop = asyncio.Event()
        sampler = (asyncio.create_task(_sample(nodes, sample_interval_s, stop, timeline))
                   if measured and sample_interval_s > 0 else None)
        try:
            return await run_load(client, workload.requests, load, follow_up=workload.follow_up,
                                  expected_total=workload.expected_total)
        finally:
            stop.set()
            if sampler is not None:
                await sampler

    result = asyncio.run(go())
    out: dict[str, Any] = {
        "workload": workload.name, "workload_params": workload.params,
        "request_rate": load.request_rate if load.request_rate != float("inf") else "inf",
        "max_concurrency": load.max_concurrency, "seed": load.seed, "goodput_slo_ms": goodput or None,
        **summarize(result.records, result.duration_s, goodput=goodput),
    }
    out["prefix_cache"] = None
    out["kv_transfer_bytes"] = None
    if measured:
        after = read_counters(nodes.cache_urls, nodes.block_size_tokens)
        replay = workload.cached_requests(result.records, replies_cached=nodes.cache_role == "decode")
        bs = nodes.block_size_tokens
        ideal = ideal_hit_blocks(replay, block_size_tokens=bs)
        capacity = capacity_blocks(after)
        lru = lru_hit_blocks(replay, block_size_tokens=bs, capacity_blocks=capacity)
        cache = cache_delta(before, after, client_query_blocks=ideal.query_blocks)
        measured_rate = cache["hit_rate"]["total"]  # type: ignore[index]
        out["prefix_cache"] = {
            **cache, "role": nodes.cache_role, "block_size_tokens": bs,
            "ideal_hit_rate": ideal.hit_rate, "offline_lru_hit_rate": lru.hit_rate,
            "offline_lru_capacity_blocks": capacity,
            "hit_rate_vs_offline_lru": measured_rate / lru.hit_rate if lru.hit_rate else None,
            # The offline optimum, and the store's own ordering per tier policy, one request at a time.
            "offline_belady_hit_rate": belady_hit_blocks(replay, block_size_tokens=bs,
                                                         capacity_blocks=capacity).hit_rate,
            **{f"offline_store_{p.replace('-', '_')}_hit_rate": policy_hit_blocks(
                replay, block_size_tokens=bs, capacity_blocks=capacity, policy=p).hit_rate
               for p in ("lru", "cold-tail")},
        }
        out["kv_transfer_bytes"] = transfer_bytes_delta(
            decode_before, read_counters(nodes.decode_urls, nodes.block_size_tokens))
    out["hit_rate_timeline"] = timeline
    out["ttfts_ms"] = [round(r.ttft_s * 1000, 3) if r.success else None for r in result.records]
    t0 = min((r.send_time_s for r in result.records), default=0.0)
    out["start_times_s"] = [round(r.send_time_s - t0, 3) for r in result.records]
    out["errors"] = sorted({r.error for r in result.records if not r.success})[:10]
    return out
