"""``kvrelay bench kernel-plan``: the measured kernel plan against the fixed rules it replaces, in one process.

Three copies of one model, each under one plan (`model.kernel_plan`): ``measured`` (timed on this machine now,
`engine.kernel_tuning`), ``builtin`` (the fixed rule the code had: the C++ few-row kernels and one-call decode step
at 1-16 rows, oneDNN above) and ``torch`` (no C++ kernel: every linear through ``F.linear`` or oneDNN's packed matmul,
whichever the plan measured faster at 17+ rows, torch's attention — what ``KVRELAY_CPU_KERNELS=0`` gave). Each
generates the same greedy work at batch 1, 4 and 16 (prompts of ``--prompt-len`` tokens, ``--max-out`` tokens
each); the plans alternate round by round and each's median is kept. Reported: output tokens per second of each
plan and the measured plan's ratio to each fixed one (>= 1: the measurement chose at least as well), with the CPU
(`model.cpu_identity.CpuIdentity.kernel_label`) and the measured plan's choices. A plan's weight copies no path
reads are freed, so the bytes each copy of the model keeps are reported too.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch
from kvrelay.benchmarks.common import emit, ensure_tiny_model, machine_label, seeded_prompt
from kvrelay.model.kernel_paths import apply_kernel_plan, linear_kernels

BATCHES = (1, 4, 16)


def kernel_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and every linear kernel's other copies (oneDNN-packed, blocked; the
    blocked copies share one buffer, counted once)."""
    storages: dict[int, int] = {}
    for tensor in model.parameters():
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    packed = 0
    for kernels in linear_kernels(model).values():
        for kernel in kernels:
            if kernel.blocked is not None:
                storages[kernel.blocked.untyped_storage().data_ptr()] = kernel.blocked.untyped_storage().nbytes()
            if kernel.packed is not None:  # oneDNN's opaque tensor: no storage to ask, its elements' bytes
                packed += kernel.packed.numel() * kernel.packed.element_size()
    return sum(storages.values()) + packed


def run(*, model_dir: str | None, prompt_len: int, max_out: int, rounds: int, dtype: str, seed: int = 0) -> dict:
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.cpu_identity import this_cpu
    from kvrelay.model.kernel_plan import FEW_ROW_BUCKETS, LINEAR_KINDS, KernelPlan, builtin_plan
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams

    path = ensure_tiny_model(model_dir)
    engines: dict[str, LLMEngine] = {}
    blocks = max(BATCHES) * (-(-(prompt_len + max_out) // 16) + 1) + 16
    # timed on this machine now (and stored over the kept plan, as `kernel_plan: measure` does)
    engines["measured"] = LLMEngine(load_model(path, dtype=dtype), EngineConfig(
        num_blocks=blocks, enable_prefix_caching=False, kernel_plan="measure"))
    measured: KernelPlan = engines["measured"].kernel_plan
    for name in ("builtin", "torch"):
        loaded = load_model(path, dtype=dtype)
        packed = any(k.packed is not None for ks in linear_kernels(loaded.model).values() for k in ks)
        plan = builtin_plan(packed=packed)
        if name == "torch":
            many = {k: ("torch",) * FEW_ROW_BUCKETS + (measured.linear[k][-1],) for k in LINEAR_KINDS}
            plan = dataclasses.replace(plan, linear=many, stack=(False,) * FEW_ROW_BUCKETS,
                                       prefill_attention="torch", decode_attention="torch")
        apply_kernel_plan(loaded.model, plan)
        engines[name] = LLMEngine(loaded, EngineConfig(num_blocks=blocks, enable_prefix_caching=False))
    vocab = engines["measured"].model_config.vocab_size
    rng = random.Random(seed)
    results: dict[str, dict] = {}
    for batch in BATCHES:
        prompts = [seeded_prompt(rng, prompt_len, vocab) for _ in range(batch)]
        params = SamplingParams(max_tokens=max_out, ignore_eos=True)
        times: dict[str, list[float]] = {n: [] for n in engines}
        for engine in engines.values():
            engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        for r in range(rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                start = time.perf_counter()
                engines[name].generate(prompts, params)
                times[name].append(time.perf_counter() - start)
        tok_s = {n: batch * max_out / statistics.median(t) for n, t in times.items()}
        results[f"batch_{batch}"] = {
            **{f"{n}_tok_per_s": round(v, 1) for n, v in tok_s.items()},
            "measured_vs_builtin": round(tok_s["measured"] / tok_s["builtin"], 3),
            "measured_vs_torch": round(tok_s["measured"] / tok_s["torch"], 3),
        }
    return {"bench": "kernel-plan", **machine_label(), "cpu": this_cpu().kernel_label, "model": path, "dtype": dtype,
            "threads": torch.get_num_threads(), "prompt_tokens": prompt_len, "max_output_tokens": max_out,
            "rounds": rounds, "plan": measured.summary(),
            "weight_bytes": {n: kernel_weight_bytes(e.model) for n, e in engines.items()}, **results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench kernel-plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny model)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-out", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    emit(run(model_dir=a.model, prompt_len=a.prompt_len, max_out=a.max_out, rounds=a.rounds, dtype=a.dtype), a.out)
    return 0
