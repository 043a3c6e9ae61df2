"""``kvrelay bench memory``: KV memory use, paged blocks vs reserving ``max_model_len`` per request.

Lengths come from the Mooncake conversation trace, scaled down by ``--scale`` (input and output
lengths divided by it). The paged figures are measured by running the real engine (tiny model) over
the scaled requests and sampling, at every step, how many allocated KV slots hold a token.
"""

from __future__ import annotations

import argparse
import math

from kvrelay.benchmarks.common import emit, ensure_tiny_model, machine_label, read_trace, seeded_prompt


def run(*, model_dir: str | None, num_requests: int, scale: int, num_blocks: int, block_size: int) -> dict:
    import random

    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams

    reqs = [r for r in read_trace(limit=num_requests)]
    lens = [(max(1, r.input_length // scale), max(1, r.output_length // scale)) for r in reqs]
    max_model_len = max(i + o for i, o in lens) + 1
    loaded = load_model(ensure_tiny_model(model_dir))
    engine = LLMEngine(loaded, EngineConfig(num_blocks=num_blocks, block_size_tokens=block_size,
                                            max_num_seqs=256, max_num_batched_tokens=4096,
                                            max_model_len=max(max_model_len, 64), enable_prefix_caching=False))
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    for i, (n_in, n_out) in enumerate(lens):
        engine.add_request(f"m{i}", seeded_prompt(rng, n_in, vocab),
                           SamplingParams(max_tokens=n_out, ignore_eos=True))
    samples_used_slots = 0
    samples_tokens = 0
    peak_running = 0
    reserved_util_num = 0
    reserved_util_den = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        if not running:
            continue
        tokens = sum(s.num_computed_tokens for s in running)
        slots = sum(len(s.block_table) for s in running) * block_size
        samples_tokens += tokens
        samples_used_slots += slots
        reserved_util_num += tokens
        reserved_util_den += len(running) * max_model_len
        peak_running = max(peak_running, len(running))
    engine.check_integrity()
    paged_frac = samples_tokens / samples_used_slots
    reserve_frac = reserved_util_num / reserved_util_den
    mean_len = sum(i + o for i, o in lens) / len(lens)
    capacity_tokens = num_blocks * block_size
    return {
        "bench": "memory",
        **machine_label(),
        "workload": {"trace_requests": num_requests, "length_scale": f"1/{scale}", "mean_tokens": mean_len,
                     "max_model_len": max_model_len, "block_size_tokens": block_size,
                     "kv_capacity_tokens": capacity_tokens},
        "paged_used_frac": round(paged_frac, 4),
        "reserved_used_frac": round(reserve_frac, 4),
        "paged_vs_reserved_frac_ratio": round(paged_frac / reserve_frac, 2),
        "paged_peak_concurrency_measured": peak_running,
        "paged_concurrency_fit": math.floor(capacity_tokens / (mean_len / paged_frac)),
        "reserved_concurrency_fit": capacity_tokens // max_model_len,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench memory", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--scale", type=int, default=32, help="divide trace lengths by this")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    emit(run(model_dir=a.model, num_requests=a.requests, scale=a.scale, num_blocks=a.num_blocks,
             block_size=a.block_size), a.out)
    return 0
