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

    def figures(self) -> dict[str, float]:
        ok = [a.seconds for a in self.answers if a.status == 200 and not a.disconnected]
        n = len(self.answers)
        return {
            "requests": n, "ok": sum(a.status == 200 for a in self.answers),
            "share_429": sum(a.status == 429 for a in self.answers) / n if n else 0.0,
            "other": sum(a.status not in (200, 429) for a in self.answers),
            "latency_mean_s": sum(ok) / len(ok) if ok else 0.0, "latency_max_s": max(ok, default=0.0),
            "wall_s": self.wall_s,
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


def main(argv: list[str] | None = None) -> int:
    """``kvrelay bench load``: start a deployment (``kvrelay up``, the tiny model by default), warm it,
    send ``--clients`` completions at once, print what came back and how long it took."""
    import argparse
    from pathlib import Path

    from benchmarks.common import emit
    from benchmarks.deployment import Deployment

    p = argparse.ArgumentParser(prog="kvrelay bench load", description="many clients at once against kvrelay up")
    p.add_argument("--model", default=".models/tiny", help="model directory (`kvrelay tiny-model .models/tiny`)")
    p.add_argument("--prefill", type=int, default=1, help="prefill nodes")
    p.add_argument("--decode", type=int, default=1, help="decode nodes")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory; `kvrelay tiny-model {a.model}` writes one")
    overrides = {"model": {"dtype": "float32"}, "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 512},
                 "prefill": {"ports": [0] * a.prefill}, "decode": {"ports": [0] * a.decode}}
    with Deployment(a.model, overrides=overrides) as d:
        warm = asyncio.run(hammer(d.url, d.model_name, clients=40, seed=1))
        report = asyncio.run(hammer(d.url, d.model_name, clients=a.clients, seed=a.seed))
    emit({"benchmark": "load", "prefill": a.prefill, "decode": a.decode, "clients": a.clients,
          "warmup_statuses": warm.statuses, "statuses": report.statuses, **report.figures(),
          "short_completions": sum(1 for x in report.answers
                                   if x.status == 200 and not x.disconnected and x.tokens != x.wanted)}, a.out)
    return 0
