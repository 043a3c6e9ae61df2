"""The pieces of ``kvrelay bench serve``: which baselines exist, starting each one, running the
workload at every rate (with repeats), and writing the report. `benchmarks.serve_bench` is the
command line; `benchmarks.serve_standard` the ``--standard`` set built from these."""

from __future__ import annotations

import argparse
import json
import math
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrelay.benchmarks import serve_report, workloads
from kvrelay.benchmarks.common import machine_label
from kvrelay.benchmarks.peer import PeerServer
from kvrelay.benchmarks.serve_client import ClientConfig, LoadConfig
from kvrelay.benchmarks.serve_metrics import parse_goodput
from kvrelay.benchmarks.serve_run import ServerNodes, run_workload

DEFAULT_BASELINES = ("disaggregated", "aggregated", "prefix-cache-off", "transformers")
# disaggregated-static: 1P1D with each node kept on its own CPUs (`kvrelay up --no-cpu-lending`);
# disaggregated-integrity-all / -off: 1P1D with ``kvstore.integrity`` all / off (the default is sampled)
INTEGRITY_BASELINES = ("disaggregated-integrity-all", "disaggregated-integrity-off")
SERVER_BASELINES = ("disaggregated", "aggregated", "prefix-cache-off", "disaggregated-static", "disaggregated-auto",
                    *INTEGRITY_BASELINES)
ALL_BASELINES = (*DEFAULT_BASELINES, "disaggregated-static", *INTEGRITY_BASELINES, "vllm")
MakeWorkload = Callable[[int], workloads.Workload]


def workload_factory(args: argparse.Namespace, model_dir: str | None) -> MakeWorkload:
    """``seed → Workload`` for ``args.workload``."""
    name = args.workload
    vocab = _vocab_size(model_dir)
    if name == "shared-prefix":
        return lambda seed: workloads.shared_prefix(
            groups=args.groups, prompts_per_group=args.prompts_per_group, system_tokens=args.system_tokens,
            question_tokens=args.question_tokens, output_tokens=args.output_tokens, seed=seed, vocab=vocab)
    if name == "multi-round":
        encode = _encoder(model_dir)
        return lambda seed: workloads.multi_round(
            users=args.users, rounds=args.rounds, system_tokens=args.system_tokens,
            question_tokens=args.question_tokens, output_tokens=args.output_tokens, encode=encode,
            max_prompt_tokens=args.max_prompt_tokens, seed=seed)
    if name == "trace":
        return lambda seed: workloads.trace(
            start=args.trace_start, num_requests=args.trace_requests, block_tokens=args.trace_block_tokens,
            time_compression=args.time_compression, max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens, seed=seed, path=args.trace)
    return lambda seed: workloads.random_prompts(
        num_requests=args.num_prompts, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
        range_ratio=args.range_ratio, seed=seed)


def _vocab_size(model_dir: str | None) -> int:
    """Token ids of random prompts are drawn below this: the model's vocabulary, or 256 without a model."""
    config = Path(model_dir or "") / "config.json"
    return int(json.loads(config.read_text())["vocab_size"]) if model_dir and config.is_file() else 256


def _encoder(model_dir: str | None) -> Callable[[str], list[int]]:
    """The model's tokenizer (no BOS) for re-tokenizing replies; the byte-level fallback is UTF-8 bytes."""
    from kvrelay.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir) if model_dir else None
    if tok is None:
        return lambda text: list(text.encode("utf-8"))
    return lambda text: tok.encode(text, add_special_tokens=False)


def first_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def run_rates(client: ClientConfig, nodes: ServerNodes, make: MakeWorkload, args: argparse.Namespace, *,
              label: str, out_dir: Path) -> list[dict[str, Any]]:
    """The workload at every ``--request-rate`` (seed ``--seed + i``); writes one JSON per run.

    With ``--repeats R`` > 1 each rate runs R times on fresh prompts (seed ``--seed + i + 1000·r``: no
    prompt of one repeat is cached by an earlier one) and the run of median output throughput is kept,
    with every repeat's throughput in ``output_throughput_repeats``: single short runs on a shared
    2-CPU machine vary by ±15%.
    """
    goodput = parse_goodput(args.goodput)
    runs = []
    for i, rate in enumerate(args.request_rate):
        load = LoadConfig(request_rate=rate, max_concurrency=args.max_concurrency, seed=args.seed,
                          progress=not args.no_progress)
        repeats = [run_workload(client, make(args.seed + i + 1000 * r), load, nodes=nodes, goodput=goodput,
                                sample_interval_s=args.sample_interval_s) for r in range(args.repeats)]
        ranked = sorted(repeats, key=lambda r: r["output_throughput"])
        run = {"baseline": label, **ranked[(len(ranked) - 1) // 2],
               "output_throughput_repeats": [r["output_throughput"] for r in repeats], **machine_label()}
        _write(out_dir / f"{label}-{run['workload']}-rate{_rate_tag(rate)}.json", run)
        print(_one_line(run), flush=True)
        runs.append(run)
    return runs


def kvstore_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``kvstore`` config of every kvrelay baseline from ``--kv-policy`` (every tier),
    ``--kv-device-bytes``, ``--kv-host-bytes`` (``0``: no host tier) and ``--kv-no-disk``; what is not
    given keeps the deployment's config."""
    kv: dict[str, Any] = {}
    policy = getattr(args, "kv_policy", None)
    sizes = {"device": getattr(args, "kv_device_bytes", None), "host": getattr(args, "kv_host_bytes", None)}
    for tier, size in sizes.items():
        if tier == "host" and size is not None and str(size).strip() == "0":
            kv["host"] = None
            continue
        section: dict[str, Any] = {} if size is None else {"bytes": size}
        if size is not None:
            section["fraction_of_free"] = None  # bytes replace a base config's fraction
        if policy is not None:
            section["policy"] = policy
        if section:
            kv[tier] = section
    if getattr(args, "kv_no_disk", False):
        kv["disk"] = None
    elif policy is not None:
        kv["disk"] = {"policy": policy}  # `Deployment` drops it when the config has no disk tier
    return {"kvstore": kv} if kv else {}


def vllm_args(args: argparse.Namespace) -> list[str]:
    """vLLM's flags for baseline 'vllm': ``--vllm-args`` split as a shell would, else ``--dtype`` of what kvrelay's
    default ``model.dtype: auto`` resolves to on this machine (vLLM's CPU build would otherwise run bf16 on a
    CPU without bf16 instructions, emulated, where kvrelay runs float32)."""
    import shlex

    from kvrelay.model.dtype import resolve_dtype

    given = getattr(args, "vllm_args", None)
    return shlex.split(given) if given is not None else ["--dtype", resolve_dtype("auto", "cpu")]


def run_baselines(args: argparse.Namespace, baselines: list[str], make: MakeWorkload, model_dir: str,
                  out_dir: Path, *, on_disaggregated: Callable[[Any], None] | None = None
                  ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Start each server baseline in turn and run every rate; then the transformers baseline.

    ``on_disaggregated(deployment)`` runs extra measurements while the disaggregated one is up.
    """
    from kvrelay.benchmarks.deployment import BASELINE_TO_OVERRIDES, BASELINE_TO_UP_ARGS, Deployment, merge

    unknown = [b for b in baselines if b not in ALL_BASELINES]
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown}; choose from {list(ALL_BASELINES)}")
    runs: list[dict[str, Any]] = []
    for name in (b for b in baselines if b in SERVER_BASELINES):
        with Deployment(model_dir, overrides=merge(BASELINE_TO_OVERRIDES[name], kvstore_overrides(args)),
                        up_args=BASELINE_TO_UP_ARGS.get(name, [])) as dep:
            bs = int(dep.config.get("kvstore", {}).get("block_size_tokens", 16))
            nodes = ServerNodes(tuple(dep.prefill_urls), tuple(dep.decode_urls), bs)
            client = ClientConfig(dep.url, dep.model_name, timeout_s=args.timeout_s)
            runs += run_rates(client, nodes, make, args, label=name, out_dir=out_dir)
            if name == "disaggregated" and on_disaggregated is not None:
                on_disaggregated(dep)
    peers = [("vllm", None)] if "vllm" in baselines else []
    peers += [("peer", args.peer_url.rstrip("/"))] if args.peer_url else []
    for label, url in peers:
        if url is None:
            extra = vllm_args(args)
            with PeerServer(args.peer_script, model_dir, extra_args=extra) as peer:
                client = ClientConfig(peer.url, first_model(peer.url), timeout_s=args.timeout_s)
                peer_runs = run_rates(client, ServerNodes(), make, args, label=label, out_dir=out_dir)
            runs += [{**r, "server_args": extra} for r in peer_runs]  # in summary.json: how vLLM was started
        else:
            client = ClientConfig(url, first_model(url), timeout_s=args.timeout_s, api_key=args.api_key)
            runs += run_rates(client, ServerNodes(), make, args, label=label, out_dir=out_dir)
    hf = None
    if "transformers" in baselines:
        from kvrelay.benchmarks.hf_offline import run_transformers

        hf = {**run_transformers(model_dir, make(args.seed).requests, batch_size=args.hf_batch_size),
              "workload": args.workload, **machine_label()}
        _write(out_dir / f"transformers-{args.workload}.json", hf)
        print(f"transformers: {hf['output_throughput']:.1f} out tok/s", flush=True)
    return runs, hf


def _rate_tag(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _write(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _one_line(run: dict[str, Any]) -> str:
    cache = run.get("prefix_cache") or {}
    hit = f" hit {cache['hit_rate']['total']:.3f} (ideal {cache['ideal_hit_rate']:.3f})" if cache else ""
    return (f"{run['baseline']:>17} {run['workload']} rate {run['request_rate']}: {run['completed']} ok "
            f"{run['failed']} failed, {run['output_throughput']:.1f} out tok/s, TTFT mean {run['mean_ttft_ms']:.0f} "
            f"ms p99 {run['p99_ttft_ms']:.0f} ms, TPOT mean {run['mean_tpot_ms']:.1f} ms{hit}{_repeats(run)}")


def _repeats(run: dict[str, Any]) -> str:
    tps = run.get("output_throughput_repeats", [])
    return f" (median of {len(tps)}: {', '.join(f'{t:.0f}' for t in tps)} tok/s)" if len(tps) > 1 else ""


def write_report(runs: list[dict[str, Any]], hf: dict[str, Any] | None, out_dir: Path, *,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plots, ``summary.md`` and ``summary.json`` for a set of runs; returns the summary."""
    plots = {}
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_workload.setdefault(r["workload"], []).append(r)
    for name, group in by_workload.items():
        if name == "trace":
            continue
        plots[f"ttft_cdf_{name}"] = str(serve_report.plot_ttft_cdf(group, out_dir / f"ttft_cdf_{name}.png"))
        plots[f"throughput_{name}"] = str(serve_report.plot_throughput(
            group, out_dir / f"throughput_{name}.png", transformers=hf if hf and hf["workload"] == name else None))
    for r in by_workload.get("trace", []):
        tag = f"{r['baseline']}-rate{r['request_rate']}"
        plots[f"trace_hit_rate_{tag}"] = str(serve_report.plot_hit_timeline(r, out_dir / f"trace_hit_rate_{tag}.png"))
    label = machine_label()
    table = serve_report.markdown_table(runs, transformers=hf)
    summary = {"bench": "serve", **label, **(extra or {}), "plots": plots,
               "runs": [{k: v for k, v in r.items() if k not in ("ttfts_ms", "start_times_s", "hit_rate_timeline")}
                        for r in runs]}
    head = f"Measured {label['date']} on {label['machine']}, {label['cpus']} CPUs, Python {label['python']}.\n\n"
    (out_dir / "summary.md").write_text(head + (extra or {}).get("headline_md", "") + table)
    _write(out_dir / "summary.json", summary)
    return summary


