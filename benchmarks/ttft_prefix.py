"""``kvrelay bench serve --standard`` part / issue 5 figure: TTFT with a cached 2,048-token prefix vs cold.

Through the router of a running deployment (``--url``) or of the default config started here. Each
repetition draws a fresh prefix P (``prefix_tokens``) and two questions q1, q2 (``question_tokens``)::

    cold:  P + q1   first sight of P: every block computed
    warm:  P + q2   same length; P's blocks are cached, only q2 is computed

Target: median(warm) / median(cold) ≤ 0.25. The tiny model's default context is 2,048 positions, so
the benchmark model is written with ``max_position_embeddings`` 4,096 (`ensure_bench_model`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import emit, machine_label
from benchmarks.serve_client import ClientConfig, RequestSpec, send_request

BENCH_MAX_POSITIONS = 4096


def ensure_bench_model(model_dir: str | None, *, max_position_embeddings: int = BENCH_MAX_POSITIONS) -> str:
    """``model_dir`` if given, else the tiny model with a longer context under ``.models/`` (written once)."""
    if model_dir:
        return model_dir
    from model.tiny import write_tiny_model

    out = Path(".models") / f"bench-tiny-{max_position_embeddings // 1024}k"
    if not (out / "config.json").exists():
        write_tiny_model(out, seed=0, max_position_embeddings=max_position_embeddings)
    return str(out)


async def _measure(client: ClientConfig, *, prefix_tokens: int, question_tokens: int, repeats: int,
                   seed: int) -> list[dict[str, float]]:
    rng = random.Random(f"ttft-prefix/{seed}")

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
            rows.append({"cold_ttft_ms": cold.ttft_s * 1000, "warm_ttft_ms": warm.ttft_s * 1000,
                         "warm_over_cold": warm.ttft_s / cold.ttft_s})
    return rows


def measure_ttft_prefix(client: ClientConfig, *, prefix_tokens: int = 2048, question_tokens: int = 32,
                        repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Cold and warm TTFT per repetition and their medians; ``warm_over_cold`` = median warm / median cold."""
    rows = asyncio.run(_measure(client, prefix_tokens=prefix_tokens, question_tokens=question_tokens,
                                repeats=repeats, seed=seed))
    cold = statistics.median(r["cold_ttft_ms"] for r in rows)
    warm = statistics.median(r["warm_ttft_ms"] for r in rows)
    return {
        "bench": "ttft_prefix", "prefix_tokens": prefix_tokens, "question_tokens": question_tokens,
        "repeats": repeats, "median_cold_ttft_ms": cold, "median_warm_ttft_ms": warm,
        "warm_over_cold": warm / cold, "median_of_ratios": statistics.median(r["warm_over_cold"] for r in rows),
        "target_warm_over_cold": 0.25, "runs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ttft_prefix", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="router root of a running server (default: start the default config here)")
    p.add_argument("--model", help="model directory (default: tiny model with 4,096 positions)")
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    kwargs = {"prefix_tokens": args.prefix_tokens, "question_tokens": args.question_tokens,
              "repeats": args.repeats, "seed": args.seed}
    if args.url:
        result = measure_ttft_prefix(ClientConfig(args.url.rstrip("/"), args.model_name), **kwargs)
        result["server"] = args.url
    else:
        from benchmarks.deployment import Deployment

        with Deployment(ensure_bench_model(args.model)) as dep:
            result = measure_ttft_prefix(ClientConfig(dep.url, dep.model_name), **kwargs)
        result["server"] = "kvrelay up, deploy/configs/local.yaml (1 prefill + 1 decode)"
    emit({**result, **machine_label()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
