"""`kvrelay bench migration`: streams that lose their decode node mid-way, with and without request migration.

Issue 30's measurement: a 1P2D deployment, ``--streams`` greedy streams of ``--max-tokens`` tokens, and the decode
node running most of them SIGKILLed ``--kill-after-s`` seconds after the first text arrived (the issue killed at 3 s
into 300-token streams; the tiny model finishes those in ~1.5 s here, so the defaults are longer streams and an
earlier kill, and the report says how many streams the victim was running). Each deployment (one
per ``router.migration_limit`` in ``--limits``; a fresh disk tier each) first serves the same streams undisturbed,
which gives the reference text and wall time; then the killed run. Per limit it reports how many streams
completed, how many equal the undisturbed run's text exactly, the moves the router counted, and the killed run's
wall time over the undisturbed one (the cost of the recovery).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kvrelay.transfer.config import TOKEN_HEADER


@dataclass(slots=True)
class StreamResult:
    """One streaming completion: the text it got, how it ended, and the error if it broke."""

    text: list[str] = field(default_factory=list)
    finish: str | None = None
    tokens: int = 0
    error: str = ""


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], first_text: asyncio.Event,
                 ) -> StreamResult:
    """POST one streaming completion and read it to the end; sets ``first_text`` at the first text piece."""
    out = StreamResult()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"].get("message", event["error"]))[:200]
                    continue
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        out.text.append(choice["text"])
                        first_text.set()
                    if choice.get("finish_reason") is not None:
                        out.finish = choice["finish_reason"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = repr(exc)[:200]
    return out


async def run_streams(url: str, bodies: list[dict[str, Any]], *, kill_after_s: float | None,
                      decode_urls: list[str],
                      token: str | None = None) -> tuple[list[StreamResult], float, str | None, int]:
    """All ``bodies`` at once; with ``kill_after_s``, SIGKILL the decode node running most streams that long
    after the first text. Returns the results, the wall time (s), the URL of the node killed and how many
    streams it was running then."""
    first_text = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=len(bodies) + 4)) as session:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(stream(session, url, b, first_text)) for b in bodies]
        victim, running = None, 0
        if kill_after_s is not None:
            await asyncio.wait_for(first_text.wait(), 300)
            await asyncio.sleep(kill_after_s)
            health = []
            for u in decode_urls:
                async with session.get(u + "/health", headers={TOKEN_HEADER: token or ""}) as resp:
                    health.append(await resp.json())
            busiest = max(range(len(decode_urls)), key=lambda i: health[i]["running"])
            victim, running = decode_urls[busiest], int(health[busiest]["running"])
            os.kill(int(health[busiest]["pid"]), signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0, victim, running


def migrations(url: str) -> dict[str, float]:
    """``kvrelay_router_migrations_total`` by outcome, from the router's ``/metrics``."""
    from kvrelay.benchmarks.deployment import get_text

    out: dict[str, float] = {}
    for line in get_text(url + "/metrics").splitlines():
        if line.startswith("kvrelay_router_migrations_total{"):
            name, value = line.rsplit(" ", 1)
            out[name.split('outcome="')[1].split('"')[0]] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    from kvrelay.benchmarks.common import emit
    from kvrelay.benchmarks.deployment import Deployment

    p = argparse.ArgumentParser(prog="kvrelay bench migration",
                                description="1P2D, one decode node SIGKILLed mid-stream, with and without migration")
    p.add_argument("--model", default=".models/tiny", help="model directory (`kvrelay tiny-model .models/tiny`)")
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=1500, help="long enough to outlive the kill on the tiny model")
    p.add_argument("--kill-after-s", type=float, default=1.0, help="seconds after the first text arrives")
    p.add_argument("--limits", default="0,3", help="router.migration_limit per deployment, comma-separated")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory; `kvrelay tiny-model {a.model}` writes one")
    limits = [int(x) for x in a.limits.split(",")]
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(16, 64))] for _ in range(a.streams)]
    runs = []
    for limit in limits:
        overrides = {"model": {"dtype": "float32"}, "prefill": {"ports": [0]}, "decode": {"ports": [0, 0]},
                     "router": {"migration_limit": limit}}
        with Deployment(a.model, overrides=overrides) as d:
            bodies = [{"model": d.model_name, "prompt": pr, "max_tokens": a.max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                      for pr in prompts]
            calm, calm_s, _, _ = asyncio.run(run_streams(d.url, bodies, kill_after_s=None, decode_urls=d.decode_urls,
                                                         token=d.token))
            if any(r.error or r.finish != "length" for r in calm):
                raise RuntimeError(f"the undisturbed run failed: {[r.error for r in calm if r.error][:3]}")
            hit, hit_s, victim, on_victim = asyncio.run(run_streams(d.url, bodies, kill_after_s=a.kill_after_s,
                                                         decode_urls=d.decode_urls, token=d.token))
            moved = migrations(d.url)
        completed = [r.finish == "length" and r.tokens == a.max_tokens and not r.error for r in hit]
        exact = ["".join(h.text) == "".join(c.text) for h, c in zip(hit, calm, strict=True)]
        runs.append({
            "migration_limit": limit, "streams": a.streams, "completed": sum(completed),
            "lost": a.streams - sum(completed), "exact": sum(e and c for e, c in zip(exact, completed, strict=True)),
            "running_on_victim_at_kill": on_victim, "migrations": moved, "victim": victim,
            "undisturbed_wall_s": calm_s, "killed_wall_s": hit_s, "killed_over_undisturbed_wall": hit_s / calm_s,
            "errors": sorted({r.error for r in hit if r.error})[:5]})
    emit({"benchmark": "migration", "streams": a.streams, "max_tokens": a.max_tokens,
          "kill_after_s": a.kill_after_s, "runs": runs}, a.out)
    return 0
