"""``kvrelay bench serve``: serving workloads against any OpenAI-compatible server, or kvrelay baselines.

    kvrelay bench serve --url http://127.0.0.1:8000 --workload shared-prefix --request-rate 2 4 inf
    kvrelay bench serve --baselines --workload trace --trace-requests 100
    kvrelay bench serve --standard            # what `make bench` runs (see `run_standard`)
    kvrelay bench serve --model .models/smollm2-135m-instruct \
        --baselines aggregated,disaggregated,vllm,transformers --groups 2 --system-tokens 256   # vs vLLM

``--baselines`` starts, one after another, kvrelay disaggregated (1 prefill + 1 decode, the default
config), aggregated (decode only, local prefill), prefix cache off (``engine.enable_prefix_caching:
false``), and runs ``transformers`` ``generate`` offline over the same prompts. Each request rate gets its
own workload seed (``--seed`` + rate index), so caches start cold at every rate and every baseline sees
the same prompts. ``vllm`` starts ``--peer-script`` (vLLM's CPU build, ``../shared/peers/vllm-cpu.sh``)
on the same model directory after the kvrelay baselines, and ``--peer-url`` adds any running
OpenAI server as baseline ``peer``; one server runs at a time. Output under ``--out-dir``: one JSON
per run, ``summary.json``, ``summary.md`` and PNG plots. Field names follow ``vllm bench serve``
(`benchmarks.serve_metrics`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvrelay.benchmarks import workloads
from kvrelay.benchmarks.peer import DEFAULT_PEER_SCRIPT
from kvrelay.benchmarks.serve_baselines import (
    ALL_BASELINES,
    DEFAULT_BASELINES,
    first_model,
    run_baselines,
    run_rates,
    workload_factory,
    write_report,
)
from kvrelay.benchmarks.serve_client import ClientConfig
from kvrelay.benchmarks.serve_metrics import parse_goodput
from kvrelay.benchmarks.serve_run import ServerNodes
from kvrelay.benchmarks.serve_standard import run_standard
from kvrelay.benchmarks.ttft_prefix import ensure_bench_model
from kvrelay.kvstore.policy import POLICY_NAMES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay bench serve", description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--url", help="server root, e.g. http://127.0.0.1:8000 (no /v1)")
    mode.add_argument("--baselines", nargs="?", const=",".join(DEFAULT_BASELINES), default=None,
                      help=f"start baselines here (comma list of {','.join(ALL_BASELINES)}; "
                      f"default {','.join(DEFAULT_BASELINES)})")
    mode.add_argument("--standard", action="store_true", help="the `make bench` set (see run_standard)")
    p.add_argument("--model", help="model directory (default: tiny model with 4,096 positions)")
    p.add_argument("--model-name", help="model name for --url (default: first of /v1/models)")
    p.add_argument("--api-key")
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="shared-prefix")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], help="req/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--out-dir", default="bench-out/serve")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per rate on fresh prompts; the median-throughput run is reported")
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers baseline batch")
    p.add_argument("--peer-url", help="with --baselines: also measure this running OpenAI server (baseline 'peer')")
    p.add_argument("--peer-script", default=str(DEFAULT_PEER_SCRIPT),
                   help="what baseline 'vllm' runs as SCRIPT serve MODEL_DIR PORT")
    p.add_argument("--vllm-args", default=None,
                   help="baseline 'vllm''s own flags (default: --dtype of the dtype kvrelay's `model.dtype: auto` "
                        "resolves to here, bf16 or float32, so both compute alike; '' for vLLM's defaults)")
    k = p.add_argument_group("kvstore of the kvrelay baselines")
    k.add_argument("--kv-policy", choices=POLICY_NAMES, help="every tier's policy (kvstore.<tier>.policy)")
    k.add_argument("--kv-device-bytes", help="kvstore.device.bytes, e.g. 64MiB")
    k.add_argument("--kv-host-bytes", help="kvstore.host.bytes, e.g. 64MiB; 0: no host tier")
    k.add_argument("--kv-no-disk", action="store_true", help="no disk tier")
    w = p.add_argument_group("workloads")
    w.add_argument("--groups", type=int, default=4)
    w.add_argument("--prompts-per-group", type=int, default=8)
    w.add_argument("--system-tokens", type=int, default=512)
    w.add_argument("--question-tokens", type=int, default=32)
    w.add_argument("--output-tokens", type=int, default=32)
    w.add_argument("--users", type=int, default=4)
    w.add_argument("--rounds", type=int, default=3)
    w.add_argument("--num-prompts", type=int, default=32, help="random workload")
    w.add_argument("--input-tokens", type=int, default=256, help="random workload")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random workload")
    w.add_argument("--trace", help="trace file (default: KVRELAY_TRACE, else the shipped "
                   "benchmarks/traces/conversation_trace.jsonl)")
    w.add_argument("--trace-start", type=int, default=0)
    w.add_argument("--trace-requests", type=int, default=150)
    w.add_argument("--trace-block-tokens", type=int, default=16, help="tokens per 512-token trace block")
    w.add_argument("--time-compression", type=float, default=1.0)
    w.add_argument("--max-prompt-tokens", type=int, default=2000)
    w.add_argument("--max-output-tokens", type=int, default=64, help="trace outputs are clamped to this")
    w.add_argument("--sample-interval-s", type=float, default=1.0, help="hit-rate timeline sampling")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_goodput(args.goodput)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.standard:
        run_standard(args, out_dir)
        return 0
    if args.url:
        url = args.url.rstrip("/")
        client = ClientConfig(url, args.model_name or first_model(url), timeout_s=args.timeout_s,
                              api_key=args.api_key)
        runs = run_rates(client, ServerNodes.discover(url), workload_factory(args, args.model), args,
                         label="server", out_dir=out_dir)
        write_report(runs, None, out_dir)
        return 0
    model_dir = ensure_bench_model(args.model)
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    runs, hf = run_baselines(args, baselines, workload_factory(args, model_dir), model_dir, out_dir)
    summary = write_report(runs, hf, out_dir)
    print(f"wrote {out_dir}/summary.md and {len(summary['plots'])} plots", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
