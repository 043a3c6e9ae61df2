"""Plots (matplotlib, Agg) and the Markdown table of ``kvrelay bench serve`` results.

Inputs are the run dicts of `benchmarks.serve_run.run_workload`, each with a ``baseline`` key added,
and the transformers dict of `benchmarks.hf_offline.run_transformers`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    import matplotlib
except ImportError as exc:  # an optional dependency: plots are for benchmark runs, not serving
    raise ImportError("kvrelay's benchmark plots need matplotlib: pip install 'kvrelay[bench]'") from exc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

Run = dict[str, Any]


def _rate_value(run: Run) -> float:
    return math.inf if run["request_rate"] == "inf" else float(run["request_rate"])


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_ttft_cdf(runs: Sequence[Run], path: Path) -> Path:
    """One panel per request rate, one TTFT CDF line per baseline."""
    rates = sorted({_rate_value(r) for r in runs})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.6), squeeze=False, sharex=True)
    for ax, rate in zip(axes[0], rates):
        for run in (r for r in runs if _rate_value(r) == rate):
            ttfts = np.sort([t for t in run["ttfts_ms"] if t is not None])
            if len(ttfts):
                ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=run["baseline"])
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{runs[0]['workload']}, rate {_rate_label(rate)} req/s")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(runs: Sequence[Run], path: Path, *, transformers: Run | None = None) -> Path:
    """Output throughput and request goodput vs offered rate per baseline (``inf`` drawn at the right)."""
    finite = sorted({_rate_value(r) for r in runs if not math.isinf(_rate_value(r))})
    inf_x = (max(finite) * 1.5) if finite else 1.0

    def x_of(run: Run) -> float:
        return inf_x if math.isinf(_rate_value(run)) else _rate_value(run)

    fig, (ax_t, ax_g) = plt.subplots(1, 2, figsize=(10, 3.8))
    for baseline in dict.fromkeys(r["baseline"] for r in runs):
        mine = sorted((r for r in runs if r["baseline"] == baseline), key=x_of)
        xs = [x_of(r) for r in mine]
        ax_t.plot(xs, [r["output_throughput"] for r in mine], marker="o", label=baseline)
        ax_g.plot(xs, [r["request_goodput"] or 0.0 for r in mine], marker="o", label=baseline)
    if transformers is not None:
        ax_t.axhline(transformers["output_throughput"], color="gray", linestyle="--",
                     label=f"transformers generate (batch {transformers['batch_size']})")
    ticks = finite + ([inf_x] if any(math.isinf(_rate_value(r)) for r in runs) else [])
    for ax, title in ((ax_t, "output tokens/s"), (ax_g, "goodput (req/s within SLO)")):
        ax.set_xticks(ticks, [_rate_label(t) if t != inf_x else "inf" for t in ticks])
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    slo = runs[0].get("goodput_slo_ms") or {}
    ax_g.set_title("goodput, SLO " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items()))
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hit_timeline(run: Run, path: Path) -> Path:
    """Hit rate per tier between samples over the trace replay, with the run's ideal and offline-LRU rates."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    timeline = run.get("hit_rate_timeline") or []
    for tier in ("device", "host", "disk"):
        pts = [(p["t_s"], p[tier]) for p in timeline if p.get(tier) is not None]
        if pts and any(v for _, v in pts):
            ax.plot(*zip(*pts), marker=".", label=f"{tier} tier")
    cache = run.get("prefix_cache") or {}
    peaks = [p[t] for p in timeline for t in ("device", "host", "disk") if p.get(t) is not None]
    if cache:
        ax.axhline(cache["ideal_hit_rate"], color="green", linestyle=":", label="ideal (whole run)")
        ax.axhline(cache["offline_lru_hit_rate"], color="gray", linestyle="--",
                   label=f"offline LRU, {cache['offline_lru_capacity_blocks']} blocks (whole run)")
        ax.axhline(cache["hit_rate"]["total"], color="black", linestyle="-", alpha=0.4, label="measured (whole run)")
        peaks.append(cache["ideal_hit_rate"])
    ax.set_ylim(0, min(1.0, 1.25 * max(peaks, default=0.8) + 0.02))
    compression = run["workload_params"].get("time_compression", 1)
    ax.set_xlabel(f"time since the replay started (s); trace time = {compression:g} × this")
    ax.set_ylabel("prefix hit rate (blocks)")
    ax.set_title(f"trace replay: {run['workload_params'].get('length_scale', '')}, "
                 f"time ÷ {run['workload_params'].get('time_compression', 1)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(runs: Sequence[Run], *, transformers: Run | None = None) -> str:
    """One row per run: load, throughput, latency percentiles, prefix hit rate next to ideal and LRU."""
    head = ("| baseline | workload | rate (req/s) | done/failed | req/s | out tok/s | goodput (req/s) "
            "| TTFT mean / p99 (ms) | TPOT mean / p99 (ms) | ITL p99 (ms) | hit rate | ideal | offline LRU |")
    lines = [head, "|" + "---|" * 13]
    for r in runs:
        cache = r.get("prefix_cache") or {}
        hit = cache.get("hit_rate", {}).get("total") if cache else None
        rate = (f"trace times ÷ {r['workload_params']['time_compression']:g}" if r["workload"] == "trace"
                else r["request_rate"])
        lines.append(
            f"| {r['baseline']} | {r['workload']} | {rate} | {r['completed']}/{r['failed']} "
            f"| {_fmt(r['request_throughput'], 2)} | {_fmt(r['output_throughput'])} "
            f"| {_fmt(r['request_goodput'], 2)} | {_fmt(r['mean_ttft_ms'])} / {_fmt(r['p99_ttft_ms'])} "
            f"| {_fmt(r['mean_tpot_ms'])} / {_fmt(r['p99_tpot_ms'])} | {_fmt(r['p99_itl_ms'])} "
            f"| {_fmt(hit, 3)} | {_fmt(cache.get('ideal_hit_rate'), 3)} "
            f"| {_fmt(cache.get('offline_lru_hit_rate'), 3)} |")
    if transformers is not None:
        t = transformers
        lines.append(f"| transformers generate (batch {t['batch_size']}) | same prompts, offline | – "
                     f"| {t['completed']}/0 | {_fmt(t['request_throughput'], 2)} | {_fmt(t['output_throughput'])} "
                     "| – | – | – | – | – | – | – |")
    return "\n".join(lines) + "\n"
