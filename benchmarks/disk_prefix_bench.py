"""`kvrelay bench disk-prefix`: TTFT with a prompt's prefix on the disk tier against computing it cold.

Issue 31's goal: a cached prefix is never slower than recomputing it. For each prefix length P, in one engine
(the model's own dtype, prefix caching on, a device tier and an LMDB disk tier in a fresh directory)::

    cold:  P + q1 on an engine that has never seen P                       every block computed
    disk:  P + q2 on a fresh engine over the same disk directory, after    P's blocks read from disk
           the first engine wrote its device tier there (`persist`)        (`kvstore.fetch_cost` decides)

Both engines first serve the same unrelated warm-up prompt (a fresh engine's first step runs cold). TTFT here is
the engine's time from the request's arrival to its first token (no HTTP), so the ratio isolates the tier read
against the compute it replaces. Reported per P: median TTFT of each over ``--repeats`` fresh prefixes, their
ratio (goal ≤ 1), and the blocks the disk engine fetched and skipped.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.common import emit, machine_label


def ttft_s(engine: Any, request_id: str, prompt: list[int]) -> float:
    """Seconds from adding ``prompt`` (one output token) to the step that returns its token; runs it to the end."""
    from kvrelay.model.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.request_id == request_id and out.new_token_ids:
                first = time.perf_counter() - t0
    assert first is not None, "the request produced no token"
    return first


def main(argv: list[str] | None = None) -> int:
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.kvstore.tiered_store import TieredStoreConfig
    from kvrelay.model.loader import load_model

    p = argparse.ArgumentParser(prog="kvrelay bench disk-prefix", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=".models/smollm2-135m-instruct", help="model directory")
    p.add_argument("--dtype", default="auto", help="weights dtype (auto: bfloat16 where the CPU has AMX/AVX512-BF16)")
    p.add_argument("--prefix-tokens", default="64,256,1024,2048,4096", help="prefix lengths, comma-separated")
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory (`kvrelay model pull smollm2-135m-instruct`)")
    lengths = [int(x) for x in a.prefix_tokens.split(",")]
    loaded = load_model(a.model, dtype=a.dtype)
    vocab = loaded.config.vocab_size
    longest = max(max(lengths) + a.question_tokens, 300) + 1
    num_blocks = -(-longest // 16) + 16
    config = EngineConfig(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=2048,
                          max_model_len=longest)
    rng = random.Random(a.seed)
    warmup = [rng.randrange(vocab) for _ in range(300)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-disk-prefix-") as tmp:
        for length in lengths:
            cold, disk, fetched, skipped = [], [], 0, 0
            for rep in range(a.repeats):
                store = TieredStoreConfig(num_device_blocks=num_blocks, disk_path=str(Path(tmp) / f"{length}-{rep}"),
                                          disk_capacity_bytes=4 << 30, device_policy="lru", disk_policy="lru")
                prefix = [rng.randrange(vocab) for _ in range(length)]
                q1, q2 = ([rng.randrange(vocab) for _ in range(a.question_tokens)] for _ in range(2))
                first = LLMEngine(loaded, config, store_config=store)
                ttft_s(first, "warm", warmup)
                cold.append(ttft_s(first, "cold", prefix + q1))
                first.store.persist()
                first.close()
                second = LLMEngine(loaded, config, store_config=store)
                ttft_s(second, "warm", warmup)
                hits_before = second.store.metrics.registry.get_sample_value(
                    "kvrelay_prefix_cache_hits_total", {"tier": "disk"}) or 0.0
                disk.append(ttft_s(second, "disk", prefix + q2))
                reg = second.store.metrics.registry
                fetched += int((reg.get_sample_value("kvrelay_prefix_cache_hits_total", {"tier": "disk"}) or 0.0)
                               - hits_before)
                skipped += int(reg.get_sample_value("kvrelay_store_fetch_skipped_blocks_total") or 0.0)
                second.close()
            c, d = statistics.median(cold), statistics.median(disk)
            rows.append({"prefix_tokens": length, "cold_ttft_s": c, "disk_ttft_s": d, "disk_over_cold": d / c,
                         "disk_hit_blocks": fetched, "fetch_skipped_blocks": skipped,
                         "cold_all_s": cold, "disk_all_s": disk})
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    emit({"benchmark": "disk-prefix", "model": a.model, "dtype": dtype, "machine": machine_label(),
          "repeats": a.repeats, "question_tokens": a.question_tokens, "rows": rows,
          "goal_met": all(r["disk_over_cold"] <= 1.0 for r in rows)}, a.out)
    return 0
