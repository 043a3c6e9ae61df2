"""`kvrelay bench goodput`: goodput under TTFT and TPOT SLOs, at equal hardware, for three deployments in one run.

Issue 31's measurement. Each deployment is one ``kvrelay up --no-cpu-lending`` (`benchmarks.deployment`, a fresh
disk tier each) with two engine nodes, each pinned to its own share of the CPUs (one core each on 2 cores)::

    2x-aggregated   two decode nodes that prefill themselves, behind one router
    1p1d            one prefill node + one decode node, router.disaggregation: always
    auto            the same nodes, router.disaggregation: auto, and the prefill node also serves whole requests
                    (prefill.serve_whole_requests): the router places a request on whichever node is less loaded,
                    keeps short prompts and prompts whose prefix the decode node holds on the decode node, and
                    sends a prompt to the prefill node when prefilling it locally would push a decode-node stream
                    past the TPOT SLO or cost more (`router.plan`)

Every deployment gets the same requests: per workload (a mix of short "chat" prompts and long "document"
prompts of random token ids, `mixed_prompts`) and per request rate (Poisson arrivals, `poisson_offsets`) fresh
prompts, so caches start cold at every rate. Per deployment, workload and rate it reports the share of requests
meeting both SLOs and each alone (`attainment`; TTFT and TPOT as ``vllm bench serve`` defines them, a failed
request meets none), mean / median / p90 TTFT and TPOT and throughput; per deployment and workload the goodput
(`goodput_rate`: the highest rate at which at least ``--attainment`` of the requests meet both SLOs, 0 if none),
and per workload auto's goodput over the better of the other two and over 2x-aggregated. The router's
``kvrelay_router_plan*`` samples are read at the end of each deployment, and the median of its TTFT error
(`ttft_error_median`) from them. Output: JSON (`benchmarks.common.emit`)
and a PNG of attainment against rate, one panel per workload, and a Markdown table (stderr and ``table_md``).

``--rounds N`` runs every deployment N times, alternating (A B C, then C B A, ...: drift of a shared machine's
speed over the run then weighs on every deployment alike), each round with fresh prompts and arrivals, and pools
each deployment's requests per workload and rate before it counts attainment. Every point lists its requests (the
server's request id, prompt tokens, TTFT and TPOT in ms, success, and the plan and KV pull time the router reports
when asked, ``kvrelay.timings``), so SLO misses can be traced to plans, and per point the hand-off of its
disaggregated requests (`handoff`: the KV pull, and the gap between the first token, from the prefill node, and
the second, from the decode node).

``--network netns`` runs each deployment across network namespaces instead (`benchmarks.netns_deployment`: each
node and the router on a host of its own, each node pinned to its own CPUs, requests and KV pulls over TCP).

The defaults fit SmolLM2-135M-Instruct on 2 CPU cores, one per node (measured 2026-12-02 on the 2-core machine):
a lone prompt of 512 tokens prefills in ~0.66 s, 1,024 in ~1.8 s and 4,096 in ~15 s, so the issue's 4k-token
documents would miss a 1 s TTFT on every deployment; long prompts are 256-512 tokens here (``--long-tokens 2048
4096`` where a node prefills 4k tokens well inside the TTFT SLO). 1P1D completed ~2.2 req/s of the mixed workload
when offered 4, and 2x-aggregated already missed TPOT at 1 req/s; rates 0.5-4 req/s bracket that. The default run
takes ~20-25 minutes, ``--quick`` ~3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.common import emit, machine_label, seeded_prompt
from kvrelay.benchmarks.goodput_rows import handoff, request_rows
from kvrelay.benchmarks.serve_client import ClientConfig, LoadConfig, RequestRecord, RequestSpec, run_load
from kvrelay.benchmarks.serve_metrics import parse_prometheus, request_tpot_s, summarize
from kvrelay.engine.scheduler import PREFILL_PACKINGS

DEPLOYMENT_TO_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "2x-aggregated": {"prefill": {"ports": []}, "decode": {"ports": [0, 0]}},
    "1p1d": {"prefill": {"ports": [0]}, "decode": {"ports": [0]}, "router": {"disaggregation": "always"}},
    "auto": {"prefill": {"ports": [0], "serve_whole_requests": True}, "decode": {"ports": [0]},
             "router": {"disaggregation": "auto"}},
}
UP_ARGS = ["--no-cpu-lending"]  # each node keeps its own core: equal hardware, nothing lent between roles
WORKLOAD_TO_LONG_SHARE: dict[str, float | None] = {"chat": 0.0, "mixed": None, "long": 0.5}  # None: --long-share
ROUTER_PLAN_PREFIX = "kvrelay_router_plan"
_TOLERANCE = 1e-9  # 27 of 30 requests meet a 0.9 target although 0.9 * 30 > 27 in floating point

# Defaults for the real model on 2 CPU cores (see the module docstring); --quick: a ~3-minute look.
FULL = {"workloads": "chat,mixed,long", "rates": "0.5,1,2,4", "requests": 30}
QUICK = {"workloads": "mixed", "rates": "0.5,2", "requests": 12}


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives of one request, seconds: time to first token and time per output token."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Attainment:
    """Shares of ``requests`` (every request sent) that met both SLOs, the TTFT SLO and the TPOT SLO."""

    requests: int
    both_frac: float
    ttft_frac: float
    tpot_frac: float


def attainment(records: Sequence[RequestRecord], slo: Slo) -> Attainment:
    """SLO attainment of ``records``: a request meets an SLO when its value is at most the SLO (TPOT as
    `request_tpot_s`: 0 for one output token); a failed request meets none.

    Raises:
        ValueError: ``records`` is empty.
    """
    if not records:
        raise ValueError("attainment of no requests is undefined; send at least one")
    ok = [r for r in records if r.success]
    ttft = [r.ttft_s <= slo.ttft_s for r in ok]
    tpot = [request_tpot_s(r) <= slo.tpot_s for r in ok]
    n = len(records)
    return Attainment(n, sum(a and b for a, b in zip(ttft, tpot)) / n, sum(ttft) / n, sum(tpot) / n)


def goodput_rate(rate_to_both_frac: Mapping[float, float], *, target_frac: float) -> float:
    """The highest rate (req/s) whose share of requests meeting both SLOs is at least ``target_frac``, also when
    a lower rate fell short (each rate is its own measurement); 0.0 when no rate reaches it."""
    return max((rate for rate, frac in rate_to_both_frac.items() if frac >= target_frac - _TOLERANCE), default=0.0)


def mixed_prompts(*, num_requests: int, long_share_frac: float, short_tokens: tuple[int, int],
                  long_tokens: tuple[int, int], output_tokens: int, seed: str, vocab: int) -> list[RequestSpec]:
    """``num_requests`` random-token prompts: ``round(num_requests * long_share_frac)`` of them long (length
    uniform in ``long_tokens``, inclusive), the rest short (``short_tokens``), in a seeded random order; each
    asks for ``output_tokens``. Token ids are drawn from ``[0, vocab)``; ``seed`` names the random stream, so
    the same arguments give the same requests.

    Raises:
        ValueError: ``long_share_frac`` outside [0, 1], or a range that is empty or starts below 1.
    """
    if not 0.0 <= long_share_frac <= 1.0:
        raise ValueError(f"long share must be in [0, 1], got {long_share_frac}")
    for name, (lo, hi) in (("short", short_tokens), ("long", long_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} prompt lengths {lo}-{hi}: use LO HI with 1 <= LO <= HI")
    rng = random.Random(f"goodput/{seed}")
    num_long = round(num_requests * long_share_frac)
    kinds = [long_tokens] * num_long + [short_tokens] * (num_requests - num_long)
    rng.shuffle(kinds)
    return [RequestSpec(tuple(seeded_prompt(rng, rng.randint(lo, hi), vocab)), output_tokens) for lo, hi in kinds]


ERROR_BUCKET = re.compile(r'^kvrelay_router_plan_ttft_error_ratio_bucket\{le="([^"]+)",plan="([^"]+)"\}$')


def ttft_error_median(plan_samples: Mapping[str, float]) -> dict[str, float]:
    """The median of the router's TTFT error (|predicted − actual| / actual), per plan and over all plans
    (``"all"``), read from its ``kvrelay_router_plan_ttft_error_ratio`` histogram as Prometheus'
    ``histogram_quantile`` reads one: linear within the bucket that holds the median (so to within a bucket's
    width, 0.05 up to 0.3); a median in the +Inf bucket reads as that bucket's lower bound. A plan without
    samples is left out; no samples at all: ``{}``."""
    plans: dict[str, dict[float, float]] = {}
    for key, value in plan_samples.items():
        if m := ERROR_BUCKET.match(key):
            plans.setdefault(m.group(2), {})[float(m.group(1))] = value
    totals: dict[float, float] = {}
    for buckets in plans.values():
        for le, count in buckets.items():
            totals[le] = totals.get(le, 0.0) + count
    medians = {}
    for plan, buckets in [*sorted(plans.items()), ("all", totals)]:
        bounds = sorted(buckets)
        if not bounds or buckets[bounds[-1]] <= 0:
            continue
        rank, lower, below = buckets[bounds[-1]] / 2, 0.0, 0.0
        for le in bounds:
            if buckets[le] >= rank:
                inside = buckets[le] - below
                medians[plan] = lower if math.isinf(le) else lower + (le - lower) * (rank - below) / inside
                break
            lower, below = le, buckets[le]
    return medians


def router_plan_samples(metrics_text: str) -> dict[str, float]:
    """The router's ``kvrelay_router_plan*`` samples, ``{'name{labels}': value}`` as exposed; empty if none."""
    return {k: v for k, v in parse_prometheus(metrics_text).items() if k.startswith(ROUTER_PLAN_PREFIX)}


@dataclass(frozen=True, slots=True)
class RatePoint:
    """One deployment, workload and rate: SLO attainment and the ``vllm bench serve`` statistics (ms, req/s) of
    its requests, pooled over ``rounds`` rounds; ``requests``: each request as `request_rows` gives it."""

    deployment: str
    workload: str
    rate: float
    attainment: Attainment
    stats: dict[str, float | int | None]
    rounds: int = 1
    requests: tuple[dict[str, Any], ...] = ()
    handoff: dict[str, float | int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Measured:
    """One round of one deployment at one workload and rate: what the client saw, and the wall time it took."""

    workload: str
    rate: float
    records: list[RequestRecord]
    duration_s: float


def pool(deployment: str, measured: Sequence[Measured], slo: Slo) -> list[RatePoint]:
    """``deployment``'s rounds pooled: per workload and rate (in the order first measured) the attainment and
    statistics of all its rounds' requests together, over their summed wall time."""
    groups: dict[tuple[str, float], list[Measured]] = {}
    for m in measured:
        groups.setdefault((m.workload, m.rate), []).append(m)
    points = []
    for (workload, rate), runs in groups.items():
        records = [r for m in runs for r in m.records]
        stats = summarize(records, sum(m.duration_s for m in runs), percentiles=(90.0,))
        points.append(RatePoint(deployment, workload, rate, attainment(records, slo),
                                {k: stats[k] for k in STAT_KEYS}, len(runs), tuple(request_rows(records)),
                                handoff(records)))
    return points


STAT_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
             "median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms")


def measure(client: ClientConfig, specs: list[RequestSpec], *, rate: float, seed: int) -> tuple[
        list[RequestRecord], float]:
    """Send ``specs`` at Poisson ``rate`` and wait for all of them; their records and the wall time (s)."""
    result = asyncio.run(run_load(client, specs, LoadConfig(request_rate=rate, seed=seed, progress=False)))
    return result.records, result.duration_s


def model_limits(model_dir: str) -> tuple[int, int]:
    """``(vocab_size, max_position_embeddings)`` from the model directory's ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 2048))


@dataclass(frozen=True, slots=True)
class Sweep:
    """What every deployment is given: per workload one list of requests per rate (``rates``, ascending), the
    warm-up requests, the SLOs, and when to stop a workload's sweep early (``stop_below_frac``)."""

    workload_to_rate_specs: dict[str, list[list[RequestSpec]]]
    rates: list[float]
    warmup: list[RequestSpec]
    slo: Slo
    stop_below_frac: float
    seed: int
    request_timeout_s: float
    prefill_packing: str | None = None  # every node's engine.prefill_packing (None: its default)


def deployment_overrides(name: str, slo: Slo, prefill_packing: str | None = None) -> dict[str, dict[str, Any]]:
    """Deployment ``name``'s config overrides, with the router told the TPOT SLO (``router.tpot_slo_s``: under
    ``auto`` a local prefill keeps the decode node's streams within it; the other plans do not read it), and
    ``engine.prefill_packing`` where given."""
    overrides = {section: dict(values) for section, values in DEPLOYMENT_TO_OVERRIDES[name].items()}
    overrides.setdefault("router", {}).update(tpot_slo_s=slo.tpot_s, ttft_slo_s=slo.ttft_s)
    if prefill_packing is not None:
        overrides["engine"] = {"prefill_packing": prefill_packing}
    return overrides


def run_deployment(name: str, model_dir: str, sweep: Sweep, *, network: str = "loopback") -> tuple[
        list[Measured], dict[str, Any]]:
    """Start deployment ``name`` (``network``: ``loopback``, one ``kvrelay up``; ``netns``, each node and the
    router on a host of its own, `benchmarks.netns_deployment`), send the warm-up requests, sweep every workload
    over the rates (skipping a workload's higher rates once the share meeting both SLOs is below
    ``stop_below_frac``), read the router's plan samples, stop it. Returns what each rate measured and what
    describes the deployment (overrides, network, CPUs per node, the router's plan samples)."""
    from kvrelay.benchmarks.deployment import Deployment, get_text
    from kvrelay.benchmarks.netns_deployment import NetnsDeployment

    points: list[Measured] = []
    overrides = deployment_overrides(name, sweep.slo, sweep.prefill_packing)
    deployment = NetnsDeployment(model_dir, overrides=overrides) if network == "netns" else \
        Deployment(model_dir, overrides=overrides, up_args=UP_ARGS)
    with deployment as d:
        client = ClientConfig(d.url, d.model_name, timeout_s=sweep.request_timeout_s,
                              extra_body={"kvrelay": {"timings": True}})
        nodes = {url: json.loads(get_text(url + "/health", token=d.token)).get("cpus")
                 for url in d.prefill_urls + d.decode_urls}
        # First steps compile and allocate: keep that out of the first measured rate.
        asyncio.run(run_load(client, sweep.warmup, LoadConfig(progress=False)))
        for workload, rate_specs in sweep.workload_to_rate_specs.items():
            for i, (rate, specs) in enumerate(zip(sweep.rates, rate_specs, strict=True)):
                records, duration_s = measure(client, specs, rate=rate, seed=sweep.seed + i)
                points.append(Measured(workload, rate, records, duration_s))
                att = attainment(records, sweep.slo)
                print(f"goodput: {name:13s} {workload:6s} {rate:6g} req/s  both {att.both_frac:.2f}  ttft "
                      f"{att.ttft_frac:.2f}  tpot {att.tpot_frac:.2f}  failed {sum(not r.success for r in records)}"
                      f"  wall {duration_s:.0f} s" + (f"  kv pull p50 {h['kv_pull_ms_median']:.0f} ms of "
                                                      f"{h['requests']}" if (h := handoff(records)) else ""),
                      file=sys.stderr)
                if att.both_frac < sweep.stop_below_frac:
                    break
        plan = router_plan_samples(get_text(d.url + "/metrics"))
    info = {"overrides": overrides, "network": network, "node_cpus": nodes,
            **({"up_args": UP_ARGS} if network == "loopback" else {})}
    if not plan:
        return points, info
    medians = ttft_error_median(plan)
    print(f"goodput: {name:13s} median TTFT error (|predicted - actual| / actual): "
          + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()), file=sys.stderr)
    return points, {**info, "router_plan": plan, "ttft_error_median": medians}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize_goodput(points: Sequence[RatePoint], *, target_frac: float) -> dict[str, dict[str, Any]]:
    """Per workload: each deployment's goodput (req/s) and, where those deployments ran, auto's ratios."""
    out: dict[str, dict[str, Any]] = {}
    for workload in dict.fromkeys(p.workload for p in points):
        rates = {}
        for dep in dict.fromkeys(p.deployment for p in points):
            mine = {p.rate: p.attainment.both_frac for p in points if p.workload == workload and p.deployment == dep}
            rates[dep] = goodput_rate(mine, target_frac=target_frac)
        entry: dict[str, Any] = {"goodput_req_s": rates}
        if {"auto", "1p1d", "2x-aggregated"} <= rates.keys():
            entry["auto_over_best_other"] = _ratio(rates["auto"], max(rates["1p1d"], rates["2x-aggregated"]))
            entry["auto_over_2x_aggregated"] = _ratio(rates["auto"], rates["2x-aggregated"])
        out[workload] = entry
    return out


def markdown_table(points: Sequence[RatePoint], goodput: Mapping[str, Mapping[str, Any]], *,
                   rates: Sequence[float]) -> str:
    """One row per workload and deployment: the share meeting both SLOs at each of ``rates`` (``–``: not run,
    the sweep stopped below ``--stop-below``), then the goodput (`summarize_goodput`'s ``goodput``)."""
    lines = ["| workload | deployment | " + " | ".join(f"{r:g} req/s" for r in rates) + " | goodput (req/s) |",
             "|---|---|" + "---|" * len(rates) + "---|"]
    for workload, entry in goodput.items():
        for dep, rate in entry["goodput_req_s"].items():
            got = {p.rate: p.attainment.both_frac for p in points if p.workload == workload and p.deployment == dep}
            cells = [f"{got[r]:.2f}" if r in got else "–" for r in rates]
            lines.append(f"| {workload} | {dep} | " + " | ".join(cells) + f" | {rate:g} |")
    return "\n".join(lines)


def plot(points: Sequence[RatePoint], path: str, *, slo: Slo, target_frac: float) -> None:
    """Attainment of both SLOs against request rate: one panel per workload, one line per deployment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(p.workload for p in points))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for dep, marker in zip(dict.fromkeys(p.deployment for p in points), "os^D"):
            pts = [p for p in points if p.workload == workload and p.deployment == dep]
            ax.plot([p.rate for p in pts], [p.attainment.both_frac for p in pts], marker=marker, label=dep)
        ax.axhline(target_frac, color="gray", linestyle="--", label=f"{target_frac:.0%}")
        ax.set(xscale="log", xlabel="request rate (req/s)", ylabel="share meeting both SLOs", ylim=(-0.03, 1.03),
               title=f"{workload} (TTFT ≤ {slo.ttft_s:g} s, TPOT ≤ {slo.tpot_s * 1000:g} ms)")
        rates = sorted({p.rate for p in points})
        ax.minorticks_off()
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay bench goodput", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/smollm2-135m-instruct",
                   help="model directory (`kvrelay model pull smollm2-135m-instruct --dir DIR`; "
                        "`kvrelay tiny-model DIR` for a quick check)")
    p.add_argument("--deployments", default=",".join(DEPLOYMENT_TO_OVERRIDES),
                   help=f"comma list of {','.join(DEPLOYMENT_TO_OVERRIDES)}")
    p.add_argument("--workloads", default=None, help=f"comma list of {','.join(WORKLOAD_TO_LONG_SHARE)} "
                   f"(chat: no long prompts, mixed: --long-share, long: half long); default {FULL['workloads']}")
    p.add_argument("--rates", default=None, help=f"Poisson request rates, req/s, comma list; default {FULL['rates']}")
    p.add_argument("--requests", type=int, default=None, help=f"requests per rate; default {FULL['requests']}")
    p.add_argument("--quick", action="store_true",
                   help=f"~3 minutes: workloads {QUICK['workloads']}, rates {QUICK['rates']}, "
                        f"{QUICK['requests']} requests per rate, unless given")
    p.add_argument("--long-share", type=float, default=0.2, help="share of long prompts in the mixed workload")
    p.add_argument("--short-tokens", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"))
    p.add_argument("--long-tokens", type=int, nargs=2, default=[256, 512], metavar=("LO", "HI"),
                   help="cut to the model's positions minus --output-tokens")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ttft-slo-s", type=float, default=1.0, help="time to first token, seconds")
    p.add_argument("--tpot-slo-s", type=float, default=0.05, help="time per output token, seconds")
    p.add_argument("--attainment", type=float, default=0.9, help="share meeting both SLOs that counts as goodput")
    p.add_argument("--stop-below", type=float, default=0.5,
                   help="skip a workload's higher rates once fewer than this share meet both SLOs (0: run all)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every deployment this many times, alternating, and pool their requests per rate")
    p.add_argument("--network", choices=("loopback", "netns"), default="loopback",
                   help="loopback: each deployment is one `kvrelay up` on this host; netns: each node and the "
                        "router on a network namespace of its own, KV crossing TCP (needs root)")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--prefill-packing", choices=PREFILL_PACKINGS, default=None,
                   help="every node's engine.prefill_packing (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --out, else bench-out/goodput.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    defaults = QUICK if a.quick else FULL
    workloads = (a.workloads or str(defaults["workloads"])).split(",")
    deployments = a.deployments.split(",")
    rates = sorted(float(x) for x in (a.rates or str(defaults["rates"])).split(","))
    num_requests = a.requests or int(defaults["requests"])
    for bad, known, flag in ((workloads, WORKLOAD_TO_LONG_SHARE, "--workloads"),
                             (deployments, DEPLOYMENT_TO_OVERRIDES, "--deployments")):
        if unknown := [x for x in bad if x not in known]:
            p.error(f"{flag}: {unknown} unknown; choose from {list(known)}")
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: run at least one round")
    if not all(0 < r < math.inf for r in rates):
        p.error(f"--rates {rates}: every rate must be a positive number of requests per second")
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory; `kvrelay model pull smollm2-135m-instruct --dir "
                f"{a.model}` or `kvrelay tiny-model {a.model}` writes one")
    vocab, max_positions = model_limits(a.model)
    room = max_positions - a.output_tokens
    long_tokens = (min(a.long_tokens[0], room), min(a.long_tokens[1], room))
    short_tokens = (min(a.short_tokens[0], room), min(a.short_tokens[1], room))
    slo = Slo(a.ttft_slo_s, a.tpot_slo_s)
    shares = {w: a.long_share if WORKLOAD_TO_LONG_SHARE[w] is None else WORKLOAD_TO_LONG_SHARE[w] for w in workloads}
    sweeps = []
    try:
        for r in range(a.rounds):  # round 0's prompts are those of a run without --rounds
            tag = f"/{a.seed}" + (f"/round{r}" if r else "")
            workload_to_rate_specs = {w: [
                mixed_prompts(num_requests=num_requests, long_share_frac=share, short_tokens=short_tokens,
                              long_tokens=long_tokens, output_tokens=a.output_tokens, seed=f"{w}/{i}{tag}",
                              vocab=vocab) for i in range(len(rates))] for w, share in shares.items()}
            warmup = mixed_prompts(num_requests=4, long_share_frac=0.5, short_tokens=short_tokens,
                                   long_tokens=long_tokens, output_tokens=4, seed=f"warm-up{tag}", vocab=vocab)
            sweeps.append(Sweep(workload_to_rate_specs, rates, warmup, slo, a.stop_below, a.seed + 1000 * r,
                                a.request_timeout_s, a.prefill_packing))
    except ValueError as exc:
        p.error(str(exc))
    measured: dict[str, list[Measured]] = {name: [] for name in deployments}
    deployment_info: dict[str, Any] = {}
    for r, sweep in enumerate(sweeps):
        for name in deployments if r % 2 == 0 else deployments[::-1]:
            got, info = run_deployment(name, a.model, sweep, network=a.network)
            measured[name].extend(got)
            if name in deployment_info:
                deployment_info[name].setdefault("later_rounds", []).append(info)
            else:
                deployment_info[name] = info
    points = [pt for name in deployments for pt in pool(name, measured[name], slo)]
    plot_path = a.plot or str(Path(a.out).with_suffix(".png") if a.out else Path("bench-out") / "goodput.png")
    plot(points, plot_path, slo=slo, target_frac=a.attainment)
    summary = summarize_goodput(points, target_frac=a.attainment)
    table = markdown_table(points, summary, rates=rates)
    print(table, file=sys.stderr)
    emit({"benchmark": "goodput", **machine_label(), "model": a.model,
          "network": a.network,
          "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "attainment_target_frac": a.attainment,
          "rates_req_s": rates, "requests_per_rate": num_requests, "rounds": a.rounds,
          "stop_below_frac": a.stop_below,
          "prompts": {"short_tokens": short_tokens, "long_tokens": long_tokens, "output_tokens": a.output_tokens,
                      "vocab": vocab, "seed": a.seed},
          "workloads": {w: {"long_share_frac": share} for w, share in shares.items()}, "deployments": deployment_info,
          "goodput": summary, "table_md": table, "runs": [asdict(pt) for pt in points], "plot": plot_path}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
