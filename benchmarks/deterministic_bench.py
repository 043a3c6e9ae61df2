"""``kvrelay bench deterministic``: what deterministic mode (``engine.deterministic``) costs, in one process.

Two copies of one model: one under the kernel plan a node takes by default (``engine.kernel_plan: auto``: timed on
this machine, or read back from the plan kept for it) and one under deterministic mode's plan
(`model.kernel_plan.deterministic_plan`: the blocked kernel at every row count, no one-call stack, the C++ decode
attention with each sequence's keys in one part, prefill as one decode row per token). Each generates the same
greedy work at batch 1, 4 and 16 (prompts of ``--prompt-len`` tokens, ``--max-out`` tokens each) and prefills one
cold prompt of ``--prefill-len`` tokens (one output token: the engine's share of a time to first token); the two
alternate round by round and each's median is kept. Reported: output tokens per second at each batch and the
prefill's seconds under each, and deterministic mode's ratio to the default (tokens per second: < 1 is slower;
prefill seconds: > 1 is slower), with the CPU (`model.cpu_identity.CpuIdentity.kernel_label`) and the default plan.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from kvrelay.benchmarks.common import emit, ensure_tiny_model, machine_label, seeded_prompt
from kvrelay.benchmarks.kernel_plan_bench import kernel_weight_bytes

BATCHES = (1, 4, 16)
MODES = ("default", "deterministic")


def run(*, model_dir: str | None, prompt_len: int, max_out: int, prefill_len: int, rounds: int, dtype: str,
        seed: int = 0) -> dict:
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.cpu_identity import this_cpu
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams

    path = ensure_tiny_model(model_dir)
    blocks = max(max(BATCHES) * (-(-(prompt_len + max_out) // 16) + 1), -(-prefill_len // 16) + 2) + 16
    engines = {mode: LLMEngine(load_model(path, dtype=dtype), EngineConfig(
        num_blocks=blocks, enable_prefix_caching=False, max_model_len=max(prefill_len, prompt_len + max_out) + 16,
        deterministic=mode == "deterministic")) for mode in MODES}
    vocab = engines["default"].model_config.vocab_size
    rng = random.Random(seed)
    results: dict[str, dict] = {}

    def alternate(work: object) -> dict[str, float]:
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                start = time.perf_counter()
                work(engines[mode])  # type: ignore[operator]
                times[mode].append(time.perf_counter() - start)
        return {m: statistics.median(t) for m, t in times.items()}

    for engine in engines.values():
        engine.generate([seeded_prompt(rng, prompt_len, vocab)], SamplingParams(max_tokens=2, ignore_eos=True))
    for batch in BATCHES:
        prompts = [seeded_prompt(rng, prompt_len, vocab) for _ in range(batch)]
        params = SamplingParams(max_tokens=max_out, ignore_eos=True)
        secs = alternate(lambda e, p=prompts, s=params: e.generate(p, s))
        tok_s = {m: batch * max_out / s for m, s in secs.items()}
        results[f"batch_{batch}"] = {**{f"{m}_tok_per_s": round(v, 1) for m, v in tok_s.items()},
                                     "deterministic_vs_default": round(tok_s["deterministic"] / tok_s["default"], 3)}
    long_prompt = [seeded_prompt(rng, prefill_len, vocab)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    secs = alternate(lambda e: e.generate(long_prompt, one))
    results["prefill"] = {**{f"{m}_s": round(s, 4) for m, s in secs.items()},
                          "deterministic_vs_default": round(secs["deterministic"] / secs["default"], 3)}
    return {"bench": "deterministic", **machine_label(), "cpu": this_cpu().kernel_label, "model": path,
            "dtype": dtype, "threads": torch.get_num_threads(), "prompt_tokens": prompt_len,
            "max_output_tokens": max_out, "prefill_tokens": prefill_len, "rounds": rounds,
            "default_plan": engines["default"].kernel_plan.summary(),
            "weight_bytes": {m: kernel_weight_bytes(e.model) for m, e in engines.items()}, **results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench deterministic", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny model)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-out", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=1900)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    emit(run(model_dir=a.model, prompt_len=a.prompt_len, max_out=a.max_out, prefill_len=a.prefill_len,
             rounds=a.rounds, dtype=a.dtype), a.out)
    return 0
