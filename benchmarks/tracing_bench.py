"""`kvrelay bench tracing`: the cost of request traces — output tok/s with every request traced and exported,
over output tok/s with tracing off, on the default deployment, in one run (issue 34; target ≥ 0.97).

Each mode is one ``kvrelay up`` of the default config (`benchmarks.deployment`: fresh ports, a fresh disk tier):

    off     no ``observability.otlp_endpoint``: no spans are made
    on      ``observability.otlp_endpoint`` = an OTLP/HTTP receiver in this process (`benchmarks.otlp_receiver`,
            which parses every export): the router and each node export one trace per request

Both get the same requests: ``--requests`` prompts of ``--prompt-tokens`` random token ids, ``--max-tokens`` out
(EOS ignored), ``--concurrency`` at once, after ``--warmup`` requests that are not counted. ``--rounds`` R runs
each mode R times in the order off, on, on, off, off, on, ... (so a drift of the machine's speed during the run
weighs on both alike); a mode's output tok/s is its output tokens over its measured seconds, summed over its
rounds. Output: JSON (`benchmarks.common.emit`) with every round's ``vllm bench serve`` summary, the ratio on / off
and the spans received.

Defaults: SmolLM2-135M-Instruct (``kvrelay model pull smollm2-135m-instruct``), 16 at once, 288-token prompts,
32 tokens out, as the serving benchmark's standard load. ``--quick`` checks that the bench runs (any model, a
few requests); its ratio means nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.common import emit, machine_label, seeded_prompt
from kvrelay.benchmarks.deployment import Deployment
from kvrelay.benchmarks.otlp_receiver import OtlpReceiver
from kvrelay.benchmarks.serve_client import ClientConfig, LoadConfig, RequestSpec, run_load
from kvrelay.benchmarks.serve_metrics import summarize

TARGET_RATIO = 0.97
MODES = ("off", "on")
DEFAULT_MODEL = Path(".models/smollm2-135m-instruct")


def tracing_report(off: dict[str, Any], on: dict[str, Any], *, spans: int, traces: int) -> dict[str, Any]:
    """The bench's verdict from each mode's `summarize` result: ``ratio`` = on / off output tok/s (None when off
    produced nothing), whether it meets `TARGET_RATIO`, and the ``spans`` / ``traces`` the receiver got."""
    base, traced = float(off["output_throughput"]), float(on["output_throughput"])
    ratio = traced / base if base > 0 else None
    return {"output_tok_s_off": base, "output_tok_s_on": traced, "ratio": ratio, "target": TARGET_RATIO,
            "met": ratio is not None and ratio >= TARGET_RATIO, "spans": spans, "traces": traces}


def _requests(args: argparse.Namespace, vocab: int, count: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(tuple(seeded_prompt(rng, args.prompt_tokens, vocab)), args.max_tokens) for _ in range(count)]


async def _load(url: str, model: str, specs: list[RequestSpec], concurrency: int) -> dict[str, Any]:
    result = await run_load(ClientConfig(url, model), specs, LoadConfig(max_concurrency=concurrency, progress=False))
    summary = summarize(result.records, result.duration_s)
    failed = [r.error for r in result.records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(specs)} requests failed; first: {failed[0]}")
    return summary


def round_order(rounds: int) -> list[str]:
    """The modes in the order they run: off, on, then on, off, and so on (``rounds`` of each)."""
    return [mode for r in range(rounds) for mode in (MODES if r % 2 == 0 else MODES[::-1])]


def combined(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one: ``output_throughput`` = all output tokens over all measured seconds."""
    seconds = sum(s["duration"] for s in summaries)
    tokens = sum(s["total_output_tokens"] for s in summaries)
    return {"output_throughput": tokens / seconds if seconds > 0 else 0.0}


def run_mode(args: argparse.Namespace, mode: str, receiver: OtlpReceiver, vocab: int) -> dict[str, Any]:
    """One deployment (``mode``: off or on), warmed, then the measured load; its summary."""
    overrides: dict[str, Any] = {"observability": {"otlp_endpoint": receiver.url}} if mode == "on" else {}
    with Deployment(args.model, overrides=overrides) as dep:
        if args.warmup:
            asyncio.run(_load(dep.url, dep.model_name, _requests(args, vocab, args.warmup, seed=1), args.concurrency))
        summary = asyncio.run(_load(dep.url, dep.model_name, _requests(args, vocab, args.requests, seed=2),
                                    args.concurrency))
    print(f"tracing {mode}: {summary['output_throughput']:.1f} output tok/s "
          f"({summary['completed']} requests in {summary['duration']:.1f} s)", file=sys.stderr)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench tracing", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="Hugging Face model directory")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8, help="requests sent first and not counted")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=288)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="deployments per mode, alternating (off, on, on, off, ...)")
    p.add_argument("--quick", action="store_true", help="a few short requests: checks that the bench runs")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.concurrency, args.prompt_tokens, args.max_tokens = 8, 2, 4, 32, 8
    if not (args.model / "config.json").is_file():
        print(f"kvrelay bench tracing: {args.model} is not a model directory; `kvrelay model pull "
              "smollm2-135m-instruct` writes the default one", file=sys.stderr)
        return 2
    from kvrelay.model.config import read_model_config  # config parsing only: no torch

    vocab = read_model_config(args.model).vocab_size
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    summaries: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with OtlpReceiver() as receiver:
        for mode in round_order(1 if args.quick else args.rounds):
            summaries[mode].append(run_mode(args, mode, receiver, vocab))
        spans = receiver.spans()
    report = tracing_report(combined(summaries["off"]), combined(summaries["on"]), spans=len(spans),
                            traces=len({s.trace_id for s in spans}))
    emit({"bench": "tracing", **machine_label(), "model": str(args.model), "requests": args.requests,
          "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
          "rounds": len(summaries["off"]),
          **report, "summaries": summaries}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
