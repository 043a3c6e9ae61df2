"""`kvrelay bench ttft-prefix` (also part of ``kvrelay bench serve --standard``; issues 5 and 63): TTFT with a
cached prefix vs cold.

Through the router of a running deployment (``--url``) or of the default config started here. Each
repetition draws a fresh prefix P (``prefix_tokens``) and two questions q1, q2 (``question_tokens``)::

    cold:  P + q1   first sight of P: every block computed
    warm:  P + q2   same length; P's blocks are cached, only q2 is computed

Each request asks the router for its plan and stage timings (``kvrelay.timings``), so every run says where each
request was prefilled (``disaggregated``: a prefill node, whose KV the decode node pulls; ``local``: the decode node)
and what each stage took (`benchmarks.goodput_rows.request_rows`); ``plans`` counts the cold → warm pairs.

Targets: median(warm) / median(cold) ≤ 0.25 (issue 5, 2,048 tokens, tiny model); ≤ 0.07 for a 1,900-token prefix
on SmolLM2-135M through the default deployment, whichever plans are taken (issue 63)::

    kvrelay bench ttft-prefix --model .models/smollm2-135m-instruct --prefix-tokens 1900 --repeats 5

Other work on the machine moves the ratio more than the plans do (``loadavg_1m`` in the answer): with CPU lending a
node computes on a CPU that other processes use, which slows a 44-token warm step more than a 1,916-token cold one
(``--disaggregation`` pins a plan, ``--no-cpu-lending`` keeps each node on its own CPUs; docs/benchmarks.md).

The tiny model's default context is 2,048 positions, so the benchmark model is written with
``max_position_embeddings`` 4,096 (`ensure_bench_model`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from kvrelay.benchmarks.common import emit, machine_label
from kvrelay.benchmarks.goodput_rows import request_rows
from kvrelay.benchmarks.serve_client import ClientConfig, RequestSpec, send_request

BENCH_MAX_POSITIONS = 4096


def ensure_bench_model(model_dir: str | None, *, max_position_embeddings: int = BENCH_MAX_POSITIONS) -> str:
    """``model_dir`` if given, else the tiny model with a longer context under ``.models/`` (written once)."""
    if model_dir:
        return model_dir
    from kvrelay.model.tiny import write_tiny_model

    out = Path(".models") / f"bench-tiny-{max_position_embeddings // 1024}k"
    if not (out / "config.json").exists():
        write_tiny_model(out, seed=0, max_position_embeddings=max_position_embeddings)
    return str(out)


async def _measure(client: ClientConfig, *, prefix_tokens: int, question_tokens: int, repeats: int,
                   seed: int) -> list[dict[str, Any]]:
    rng = random.Random(f"ttft-prefix/{seed}")
    client = dataclasses.replace(client, extra_body={**(client.extra_body or {}), "kvrelay": {"timings": True}})

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(256) for _ in range(n))

    rows = []
    async with aiohttp.ClientSession() as session:
        warmup = await send_request(session, client, RequestSpec(toks(64), 2))
        if not warmup.success:
            raise RuntimeError(f"warm-up request failed: {warmup.error}")
        for _ in range(repeats):
            prefix = toks(prefix_tokens)
            cold = await send_request(session, client, RequestSpec(prefix + toks(question_tokens), 4))
            warm = await send_request(session, client, RequestSpec(prefix + toks(question_tokens), 4))
            for rec in (cold, warm):
                if not rec.success:
                    raise RuntimeError(f"request failed: {rec.error}")
            cold_row, warm_row = request_rows([cold, warm])
            rows.append({"cold_ttft_ms": cold.ttft_s * 1000, "warm_ttft_ms": warm.ttft_s * 1000,
                         "warm_over_cold": warm.ttft_s / cold.ttft_s, "cold_plan": cold_row["plan"],
                         "warm_plan": warm_row["plan"], "cold_stages_ms": cold_row["stages_ms"],
                         "warm_stages_ms": warm_row["stages_ms"]})
    return rows


def measure_ttft_prefix(client: ClientConfig, *, prefix_tokens: int = 2048, question_tokens: int = 32,
                        repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Cold and warm TTFT per repetition and their medians; ``warm_over_cold`` = median warm / median cold;
    ``plans``: how many repetitions took each cold → warm pair of plans (the router's ``kvrelay`` answer field;
    "" where the server reported none); ``loadavg_1m``: the machine's 1-minute load average before and after (other
    work on a shared machine slows small steps most: the warm request's more than the cold one's)."""
    load_before = os.getloadavg()[0]
    rows = asyncio.run(_measure(client, prefix_tokens=prefix_tokens, question_tokens=question_tokens,
                                repeats=repeats, seed=seed))
    cold = statistics.median(r["cold_ttft_ms"] for r in rows)
    warm = statistics.median(r["warm_ttft_ms"] for r in rows)
    return {
        "bench": "ttft_prefix", "prefix_tokens": prefix_tokens, "question_tokens": question_tokens,
        "repeats": repeats, "median_cold_ttft_ms": cold, "median_warm_ttft_ms": warm,
        "warm_over_cold": warm / cold, "median_of_ratios": statistics.median(r["warm_over_cold"] for r in rows),
        "target_warm_over_cold": 0.25,
        "plans": dict(Counter(f"{r['cold_plan']} -> {r['warm_plan']}" for r in rows)),
        "loadavg_1m": [load_before, os.getloadavg()[0]], "runs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench ttft-prefix", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="router root of a running server (default: start the default config here)")
    p.add_argument("--model", help="model directory (default: tiny model with 4,096 positions)")
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disaggregation", choices=("always", "never", "auto"),
                   help="router.disaggregation of the deployment started here (default: the config's, auto)")
    p.add_argument("--no-cpu-lending", action="store_true",
                   help="start the deployment with `kvrelay up --no-cpu-lending` (each node on its own CPUs only)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    kwargs = {"prefix_tokens": args.prefix_tokens, "question_tokens": args.question_tokens,
              "repeats": args.repeats, "seed": args.seed}
    if args.url:
        result = measure_ttft_prefix(ClientConfig(args.url.rstrip("/"), args.model_name), **kwargs)
        result["server"] = args.url
    else:
        from kvrelay.benchmarks.deployment import Deployment

        overrides = {"router": {"disaggregation": args.disaggregation}} if args.disaggregation else None
        up_args = ["--no-cpu-lending"] if args.no_cpu_lending else []
        with Deployment(ensure_bench_model(args.model), overrides=overrides, up_args=up_args) as dep:
            result = measure_ttft_prefix(ClientConfig(dep.url, dep.model_name), **kwargs)
        result["server"] = " ".join(["kvrelay up", *up_args, "deploy/configs/local.yaml (1 prefill + 1 decode)"]) + (
            f", router.disaggregation {args.disaggregation}" if args.disaggregation else "")
    emit({**result, **machine_label()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
