"""Many clients at once against a deployment's OpenAI API: what each got back, and how long it took.

`hammer` opens ``clients`` concurrent completions (half streaming, mixed prompt and output lengths,
every ``disconnect_every``-th streaming client hanging up after its first chunk) and reports every
answer. `kvrelay bench load` prints its figures; the load test asserts on the same report.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp


@dataclass(frozen=True, slots=True)
class Answer:
    """One client's outcome. ``tokens``: completion tokens the server reported (``usage``; for a
    client that hung up, the chunks it read); ``wanted``: ``max_tokens`` it asked for."""

    status: int
    stream: bool
    disconnected: bool
    tokens: int
    wanted: int
    seconds: float
    error: str = ""
    retry_after: str | None = None


@dataclass(slots=True)
class LoadReport:
    answers: list[Answer] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def statuses(self) -> dict[int, int]:
        return dict(sorted(Counter(a.status for a in self.answers).items()))

    @property
    def output_tokens(self) -> int:
        """Completion tokens of the answers that were read to the end."""
        return sum(a.tokens for a in self.answers if a.status == 200 and not a.disconnected)

    def figures(self) -> dict[str, float]:
        ok = sorted(a.seconds for a in self.answers if a.status == 200 and not a.disconnected)
        n = len(self.answers)
        return {
            "requests": n, "ok": sum(a.status == 200 for a in self.answers),
            "share_429": sum(a.status == 429 for a in self.answers) / n if n else 0.0,
            "other": sum(a.status not in (200, 429) for a in self.answers),
            "latency_mean_s": sum(ok) / len(ok) if ok else 0.0, "latency_max_s": max(ok, default=0.0),
            "latency_p99_s": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else 0.0,
            "wall_s": self.wall_s, "output_tokens": self.output_tokens,
        }


def _prompt(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(rng.randrange(8, 200)))


async def _one(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random, *, stream: bool,
               disconnect: bool) -> Answer:
    wanted = rng.randrange(4, 33)
    body = {"model": model, "prompt": _prompt(rng), "max_tokens": wanted, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = await resp.text()
                return Answer(resp.status, stream, False, 0, wanted, time.perf_counter() - t0, text[:300],
                              resp.headers.get("Retry-After"))
            if not stream:
                data = await resp.json()
                return Answer(200, False, False, data["usage"]["completion_tokens"], wanted,
                              time.perf_counter() - t0)
            tokens, error = 0, ""
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"])[:300]
                    break
                if chunk.get("usage"):  # the last chunk: the server's count
                    tokens = chunk["usage"]["completion_tokens"]
                    continue
                tokens += 1
                if disconnect:
                    resp.close()  # hang up mid-stream
                    return Answer(200, True, True, tokens, wanted, time.perf_counter() - t0)
            return Answer(200 if not error else 599, True, False, tokens, wanted, time.perf_counter() - t0, error)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Answer(0, stream, False, 0, wanted, time.perf_counter() - t0, repr(exc)[:300])


async def hammer(url: str, model: str, *, clients: int, seed: int = 0, disconnect_every: int = 10,
                 timeout_s: float = 600.0) -> LoadReport:
    """``clients`` completions at once (see the module docstring). Status 0: the connection failed;
    599: a stream that ended with an error event."""
    rng = random.Random(seed)
    plans = [(rng.random() < 0.5, random.Random(rng.random())) for _ in range(clients)]
    connector = aiohttp.TCPConnector(limit=0)
    report = LoadReport()
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        report.answers = list(await asyncio.gather(*(
            _one(session, url, model, r, stream=stream, disconnect=stream and i % disconnect_every == 0)
            for i, (stream, r) in enumerate(plans))))
    report.wall_s = time.perf_counter() - t0
    return report


async def saturate(url: str, model: str, *, concurrency: int, requests: int, seed: int = 3) -> float:
    """Output tokens per second of the deployment kept full: ``concurrency`` clients each sending the load's
    requests (non-streaming, nobody hanging up) back to back, ``requests`` in all. The throughput a burst's
    ideal latency is measured against."""
    rng = random.Random(seed)
    plans = [random.Random(rng.random()) for _ in range(requests)]
    answers: list[Answer] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker() -> None:
            while plans:
                answers.append(await _one(session, url, model, plans.pop(), stream=False, disconnect=False))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    bad = [a for a in answers if a.status != 200]
    if bad:
        raise RuntimeError(f"saturating run: {len(bad)} requests failed, e.g. {bad[0]}")
    return sum(a.tokens for a in answers) / wall


def main(argv: list[str] | None = None) -> int:
    """``kvrelay bench load``: for each layout, start a deployment (``kvrelay up``, the tiny model by default,
    a fresh disk tier each), warm it, measure its throughput kept full (`saturate`), then send ``--clients``
    completions at once; print what came back and the latencies against the ideal (the burst's output tokens
    over that throughput: the time the deployment needs at least)."""
    import argparse
    from pathlib import Path

    from kvrelay.benchmarks.common import emit
    from kvrelay.benchmarks.deployment import Deployment

    p = argparse.ArgumentParser(prog="kvrelay bench load", description="many clients at once against kvrelay up")
    p.add_argument("--model", default=".models/tiny", help="model directory (`kvrelay tiny-model .models/tiny`)")
    p.add_argument("--layouts", default="1x1,2x2", help="prefill x decode nodes per deployment, comma-separated")
    p.add_argument("--clients", type=int, default=4000)
    p.add_argument("--max-queued-requests", type=int, default=None, help="router.max_queued_requests")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory; `kvrelay tiny-model {a.model}` writes one")
    layouts = []
    for item in a.layouts.split(","):
        prefill, _, decode = item.partition("x")
        if not (prefill.isdigit() and decode.isdigit() and int(decode) >= 1):
            p.error(f"--layouts: {item!r} is not PxD, e.g. 1x1")
        layouts.append((int(prefill), int(decode)))
    max_num_seqs = 32
    runs = []
    for prefill, decode in layouts:
        overrides = {"model": {"dtype": "float32"},
                     "engine": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 512},
                     "prefill": {"ports": [0] * prefill}, "decode": {"ports": [0] * decode}}
        if a.max_queued_requests is not None:
            overrides["router"] = {"max_queued_requests": a.max_queued_requests}
        with Deployment(a.model, overrides=overrides) as d:
            warm = asyncio.run(hammer(d.url, d.model_name, clients=40, seed=1))
            tokens_per_s = asyncio.run(saturate(d.url, d.model_name, concurrency=max_num_seqs * decode,
                                                requests=20 * max_num_seqs * decode))
            report = asyncio.run(hammer(d.url, d.model_name, clients=a.clients, seed=a.seed))
        figures = report.figures()
        ideal_s = report.output_tokens / tokens_per_s
        runs.append({
            "layout": f"{prefill}P{decode}D", "warmup_statuses": warm.statuses, "statuses": report.statuses,
            **figures, "saturated_output_tokens_per_s": tokens_per_s, "ideal_s": ideal_s,
            "latency_mean_vs_ideal": figures["latency_mean_s"] / ideal_s,
            "latency_p99_vs_ideal": figures["latency_p99_s"] / ideal_s,
            "short_completions": sum(1 for x in report.answers
                                     if x.status == 200 and not x.disconnected and x.tokens != x.wanted)})
    emit({"benchmark": "load", "clients": a.clients, "max_queued_requests": a.max_queued_requests,
          "runs": runs}, a.out)
    return 0
