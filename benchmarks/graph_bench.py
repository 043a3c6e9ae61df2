"""``kvrelay bench cuda-graphs``: an engine decode step replayed from a CUDA graph vs the same step run eagerly.

Two engines over one loaded model — ``cuda_graphs: false`` and graphs captured for the batch size — take the
same ``batch`` greedy requests of ``context`` prompt tokens; once every prompt is prefilled, each runs
``steps`` decode steps (a step is `engine.engine.LLMEngine.step`: inputs, forward, sampling). Reported per
batch size: the median step time of each, their ratio (graph / eager; the issue-19 goal is ≤ 0.5 at batch 1),
and whether both produced the same tokens (in bf16 they may not: a graph's attention splits over the model's
whole context, eager's over the batch's tables, so sums round differently). The engines alternate in rounds,
so drift hits both.

On a CPU there are no graphs: ``--device cpu`` runs the padded static-input forward a graph would replay
(``captured: false`` in the output), which checks the bench, not the speed-up.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from kvrelay.benchmarks.common import emit, ensure_tiny_model, machine_label, seeded_prompt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_steps(engine: Any, prompts: list[list[int]], steps: int, device: torch.device) -> tuple[list[float],
                                                                                                   list[list[int]]]:
    """Prefill ``prompts`` (not timed), then time ``steps`` decode steps; returns per-step seconds and tokens."""
    from kvrelay.model.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    while len(tokens) < len(prompts):  # every prompt prefilled: its first token is out
        step()
    times = []
    while engine.has_unfinished():
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, [tokens[f"r{i}"] for i in range(len(prompts))]


def run(*, model_dir: str | None, device: str, dtype: str, context: int, batches: list[int], steps: int,
        rounds: int, seed: int) -> dict:
    from kvrelay.engine.cuda_graphs import DecodeGraphs
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model

    path = ensure_tiny_model(model_dir)
    loaded = load_model(path, dtype=dtype, device=device)
    dev = next(loaded.model.parameters()).device
    rng = random.Random(seed)
    results: dict[str, Any] = {}
    for batch in batches:
        prompts = [seeded_prompt(rng, context, loaded.config.vocab_size) for _ in range(batch)]
        blocks = batch * (-(-(context + steps + 2) // 16) + 1) + 8
        max_model_len = context + steps + 16
        common = {"num_blocks": blocks, "max_num_seqs": batch, "max_num_batched_tokens": batch * context,
                  "max_model_len": max_model_len, "enable_prefix_caching": False}
        eager = LLMEngine(loaded, EngineConfig(**common, cuda_graphs=False))
        graphed = LLMEngine(loaded, EngineConfig(**common, cuda_graph_batch_sizes=(batch,)))
        if graphed.runner.graphs is None:  # off CUDA: the static-input forward, uncaptured
            graphed.runner.graphs = DecodeGraphs(graphed.model, graphed.kv_pool, graphed.runner.backend,
                                                 sizes=(batch,), max_model_len=max_model_len, capture=False)
        _decode_steps(eager, prompts, 2, dev)  # warm-up: compiles, allocator
        _decode_steps(graphed, prompts, 2, dev)
        eager_s: list[float] = []
        graph_s: list[float] = []
        same = True
        for _ in range(rounds):
            e_times, e_tokens = _decode_steps(eager, prompts, steps, dev)
            g_times, g_tokens = _decode_steps(graphed, prompts, steps, dev)
            eager_s += e_times
            graph_s += g_times
            same = same and e_tokens == g_tokens
        e_med, g_med = statistics.median(eager_s), statistics.median(graph_s)
        results[f"batch_{batch}"] = {
            "eager_step_ms": round(e_med * 1e3, 3), "graph_step_ms": round(g_med * 1e3, 3),
            "graph_vs_eager": round(g_med / e_med, 3), "same_tokens": same,
            "replays": graphed.runner.graphs.replays, "steps_timed": len(graph_s),
            "captured": graphed.runner.graphs.capture,  # False: off CUDA, or the capture failed (see the log)
        }
    return {"bench": "cuda-graphs", **machine_label(), "model": path, "device": str(dev), "dtype": dtype,
            "context_tokens": context, "rounds": rounds, **results,
            "goal": "graph_vs_eager <= 0.5 at batch 1 (issue 19)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench cuda-graphs", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    emit(run(model_dir=a.model, device=a.device, dtype=a.dtype, context=a.context,
             batches=[int(b) for b in a.batch.split(",")], steps=a.steps, rounds=a.rounds, seed=a.seed), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
