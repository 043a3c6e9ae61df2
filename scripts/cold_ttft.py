#!/usr/bin/env python3
"""Issue 63: the cold time to first token of a 1,932-token prompt, kvrelay against vLLM's CPU build at an equal
256 MiB of KV, one server at a time: kvrelay (`make serve`'s config), vLLM, kvrelay again; 5 distinct cold prompts
each (random token ids: no shared prefix), streamed, one output token; prints one JSON line with each run's seconds,
the medians and their ratio.

    flock /tmp/kvrelay-bench.lock .venv/bin/python scripts/cold_ttft.py   # ~10 min on 2 cores (vLLM's start)
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from pathlib import Path

from kvrelay.benchmarks.deployment import Deployment
from kvrelay.benchmarks.peer import DEFAULT_PEER_SCRIPT, PeerServer
from kvrelay.deploy.config import DEFAULT_CONFIG

MODEL = Path(".models/smollm2-135m-instruct").resolve()
PROMPT_TOKENS, RUNS = 1932, 5
KV = {"kvstore": {"device": {"bytes": "256MiB", "fraction_of_free": None}}}


def ttft(url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending ``prompt`` (streamed completion, one token) to its first token's chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if line.startswith(b"data: ") and b"choices" in line:
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: the stream ended without a token")


def runs(url: str, model: str, rng: random.Random) -> list[float]:
    ttft(url, model, [rng.randrange(300, 40000) for _ in range(64)])  # warm-up
    return [ttft(url, model, [rng.randrange(300, 40000) for _ in range(PROMPT_TOKENS)]) for _ in range(RUNS)]


def main() -> None:
    rng = random.Random(7)
    out: dict[str, list[float]] = {}
    with Deployment(MODEL, base_config=DEFAULT_CONFIG, overrides=KV) as d:
        out["kvrelay_1"] = runs(d.url, d.model_name, rng)
    with PeerServer(DEFAULT_PEER_SCRIPT, MODEL, extra_args=["--kv-cache-memory-bytes", str(256 << 20)],
                    env={"VLLM_CPU_KVCACHE_SPACE": ""}) as peer:
        out["vllm"] = runs(peer.url, "peer", rng)
    with Deployment(MODEL, base_config=DEFAULT_CONFIG, overrides=KV) as d:
        out["kvrelay_2"] = runs(d.url, d.model_name, rng)
    kvrelay = statistics.median(out["kvrelay_1"] + out["kvrelay_2"])
    vllm = statistics.median(out["vllm"])
    print(json.dumps({**{k: [round(x, 3) for x in v] for k, v in out.items()}, "kvrelay_median_s": round(kvrelay, 3),
                      "vllm_median_s": round(vllm, 3), "ratio": round(kvrelay / vllm, 3)}))


if __name__ == "__main__":
    main()
