"""The standard serving set that ``make bench`` runs (``kvrelay bench serve --standard``), sized for a
2-CPU machine without a GPU (tiny model, 4,096 positions). About 4–5 minutes here (all of `make bench`: ~6).

1. **Baselines on shared-prefix** (4 groups × 8 prompts, 512-token system prompt, 32-token question,
   32 output tokens) at 2, 8 and ``inf`` req/s: kvrelay disaggregated (default config), aggregated,
   prefix cache off, and ``transformers`` ``generate`` (batch 16) over the same prompts.
2. While the disaggregated deployment is up: **TTFT with a cached 2,048-token prefix vs cold**
   (`benchmarks.ttft_prefix`, 5 repetitions) and **multi-round** chat (4 users × 3 rounds).
3. **Trace replay** (Mooncake conversation trace, first 300 requests, 512 → 16 tokens per block, time ÷ 2)
   on a disaggregated deployment with small tiers (`TRACE_TIERS`) so that capacity binds; hit rate per
   tier over time next to the ideal and the offline-LRU hit rate at that capacity.

Headline ratios go to ``summary.json`` (``headline``) and the top of ``summary.md``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.serve_baselines import run_baselines, run_rates, workload_factory, write_report
from kvrelay.benchmarks.serve_client import ClientConfig
from kvrelay.benchmarks.serve_run import ServerNodes
from kvrelay.benchmarks.ttft_prefix import ensure_bench_model, measure_ttft_prefix

SHARED_PREFIX = {"workload": "shared-prefix", "groups": 4, "prompts_per_group": 8, "system_tokens": 512,
                 "question_tokens": 32, "output_tokens": 32, "request_rate": [2.0, 8.0, math.inf],
                 "goodput": ["ttft:250", "tpot:25"]}
MULTI_ROUND = {"workload": "multi-round", "users": 4, "rounds": 3, "system_tokens": 256, "request_rate": [math.inf]}
TRACE = {"workload": "trace", "trace_start": 0, "trace_requests": 300, "trace_block_tokens": 16,
         "time_compression": 2.0, "max_output_tokens": 32, "request_rate": [math.inf], "sample_interval_s": 2.0}
# About a third of the replay's ~7,000 distinct blocks fit: the offline-LRU rate sits well below the ideal.
TRACE_TIERS = {"kvstore": {"device": {"bytes": "4MiB"}, "host": {"bytes": "8MiB", "fraction_of_free": None},
                           "disk": {"bytes": "16MiB"}}}


def _with(args: argparse.Namespace, values: dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **values})


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def headline(runs: list[dict[str, Any]], hf: dict[str, Any] | None, ttft: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 7 asks for, as ratios measured in this run."""
    def find(baseline: str, workload: str, rate: Any) -> dict[str, Any] | None:
        return next((r for r in runs if r["baseline"] == baseline and r["workload"] == workload
                     and r["request_rate"] == rate), None)

    out: dict[str, Any] = {"warm_over_cold_ttft": ttft["warm_over_cold"],
                           "warm_ttft_ms": ttft["median_warm_ttft_ms"], "cold_ttft_ms": ttft["median_cold_ttft_ms"]}
    trace = next((r for r in runs if r["workload"] == "trace"), None)
    if trace and trace["prefix_cache"]:
        c = trace["prefix_cache"]
        out.update(trace_hit_rate=c["hit_rate"]["total"], trace_hit_rate_by_tier=c["hit_rate"],
                   trace_ideal_hit_rate=c["ideal_hit_rate"], trace_offline_lru_hit_rate=c["offline_lru_hit_rate"],
                   trace_lru_capacity_blocks=c["offline_lru_capacity_blocks"],
                   trace_hit_rate_over_offline_lru=c["hit_rate_vs_offline_lru"])
    for name in ("disaggregated", "aggregated"):
        r = find(name, "shared-prefix", "inf")
        if r and hf:
            out[f"{name}_over_transformers_output_throughput"] = r["output_throughput"] / hf["output_throughput"]
    per_rate = {}
    for rate in SHARED_PREFIX["request_rate"]:
        key = "inf" if math.isinf(rate) else rate
        d, a, off = (find(b, "shared-prefix", key) for b in ("disaggregated", "aggregated", "prefix-cache-off"))
        if d and a:
            per_rate[str(key)] = {
                "disagg_over_agg_mean_ttft": _ratio(d["mean_ttft_ms"], a["mean_ttft_ms"]),
                "disagg_over_agg_p99_ttft": _ratio(d["p99_ttft_ms"], a["p99_ttft_ms"]),
                "disagg_over_agg_mean_tpot": _ratio(d["mean_tpot_ms"], a["mean_tpot_ms"]),
                "disagg_over_agg_p99_tpot": _ratio(d["p99_tpot_ms"], a["p99_tpot_ms"]),
                "cache_on_over_off_mean_ttft": _ratio(d["mean_ttft_ms"], off["mean_ttft_ms"]) if off else None,
            }
    out["shared_prefix_by_rate"] = per_rate
    out["kv_transfer_bytes_disaggregated"] = sum(r["kv_transfer_bytes"] or 0 for r in runs
                                                 if r["baseline"].startswith("disaggregated"))
    return out


def headline_markdown(h: dict[str, Any]) -> str:
    """A few lines for the top of ``summary.md``."""
    def f(x: Any, d: int = 2) -> str:
        return "–" if x is None else f"{x:.{d}f}"

    lines = [f"* TTFT, 2,048-token prefix cached vs cold (median of 5): {f(h['warm_ttft_ms'], 0)} ms vs "
             f"{f(h['cold_ttft_ms'], 0)} ms → warm/cold **{f(h['warm_over_cold_ttft'], 3)}** (target ≤ 0.25)."]
    if "trace_hit_rate" in h:
        lines.append(f"* Trace replay hit rate {f(h['trace_hit_rate'], 3)} vs offline LRU "
                     f"{f(h['trace_offline_lru_hit_rate'], 3)} at {h['trace_lru_capacity_blocks']} blocks "
                     f"(ideal {f(h['trace_ideal_hit_rate'], 3)}) → **{f(h['trace_hit_rate_over_offline_lru'])}** "
                     "(target ≥ 0.95).")
    for name in ("disaggregated", "aggregated"):
        if f"{name}_over_transformers_output_throughput" in h:
            lines.append(f"* Output throughput, {name} kvrelay / transformers generate, all requests at once: "
                         f"**{f(h[f'{name}_over_transformers_output_throughput'])}×**.")
    for rate, r in h["shared_prefix_by_rate"].items():
        lines.append(f"* Rate {rate} req/s, disaggregated / aggregated: mean TTFT {f(r['disagg_over_agg_mean_ttft'])}, "
                     f"mean TPOT {f(r['disagg_over_agg_mean_tpot'])}, p99 TPOT {f(r['disagg_over_agg_p99_tpot'])}; "
                     f"prefix cache on / off mean TTFT {f(r['cache_on_over_off_mean_ttft'])}.")
    lines.append(f"* KV bytes moved prefill → decode (disaggregated runs): {h['kv_transfer_bytes_disaggregated']:.0f}.")
    return "\n".join(lines) + "\n\n"


def run_standard(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """Run the whole standard set; returns the summary written to ``out_dir/summary.json``."""
    from kvrelay.benchmarks.deployment import Deployment

    model_dir = ensure_bench_model(args.model)
    shared = _with(args, SHARED_PREFIX)
    extra_runs: list[dict[str, Any]] = []
    ttft: dict[str, Any] = {}

    def on_disaggregated(dep: Deployment) -> None:
        client = ClientConfig(dep.url, dep.model_name, timeout_s=args.timeout_s)
        ttft.update(measure_ttft_prefix(client, prefix_tokens=2048, question_tokens=32, repeats=5, seed=args.seed))
        print(f"ttft_prefix: warm/cold {ttft['warm_over_cold']:.3f}", flush=True)
        nodes = ServerNodes(tuple(dep.prefill_urls), tuple(dep.decode_urls), 16)
        multi = _with(args, MULTI_ROUND)
        extra_runs.extend(run_rates(client, nodes, workload_factory(multi, model_dir), multi,
                                    label="disaggregated", out_dir=out_dir))

    runs, hf = run_baselines(shared, ["disaggregated", "aggregated", "prefix-cache-off", "transformers"],
                             workload_factory(shared, model_dir), model_dir, out_dir, on_disaggregated=on_disaggregated)
    trace_args = _with(args, TRACE)
    with Deployment(model_dir, overrides=TRACE_TIERS) as dep:
        nodes = ServerNodes(tuple(dep.prefill_urls), tuple(dep.decode_urls), 16)
        client = ClientConfig(dep.url, dep.model_name, timeout_s=args.timeout_s)
        extra_runs += run_rates(client, nodes, workload_factory(trace_args, model_dir), trace_args,
                                label="disaggregated-small-tiers", out_dir=out_dir)
    all_runs = runs + extra_runs
    h = headline(all_runs, hf, ttft)
    extra = {"headline": h, "headline_md": headline_markdown(h), "ttft_prefix": ttft, "transformers": hf,
             "trace_tiers": TRACE_TIERS["kvstore"], "model": model_dir}
    summary = write_report(all_runs, hf, out_dir, extra=extra)
    print(headline_markdown(h), flush=True)
    return summary
