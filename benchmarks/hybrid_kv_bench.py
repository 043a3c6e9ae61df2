"""``kvrelay bench hybrid-kv``: KV a hybrid sliding/full model holds per sequence, against all-full paging.

gpt-oss pages its KV in two block groups (`model.config.ModelConfig.kv_groups`): the full layers' and the
sliding layers'. The engine gives a sliding block back once it falls out of the window, so at L tokens a
sequence holds ``ceil(L/B)`` full-layer blocks and about ``ceil(W/B) + 1`` sliding-layer ones, where a
layout treating every layer as full (one block of all layers per 16 tokens, as before) holds ``ceil(L/B)``
blocks of twice the bytes. Measured on the real engine (tiny gpt-oss, window 32 unless ``--model``): a
batch of requests whose sequences end at ``k × window`` tokens; at each sequence's last decode step, the
blocks its table holds and their bytes, against the all-full layout of the same tokens. The limit as L
grows is the fraction of full layers.
"""

from __future__ import annotations

import argparse
import random

from kvrelay.benchmarks.common import emit, ensure_tiny_model, machine_label, seeded_prompt


def run(*, model_dir: str | None, multiples: list[int], batch: int) -> dict:
    from kvrelay.engine.block_tables import held
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams

    loaded = load_model(ensure_tiny_model(model_dir, arch="gpt-oss", layers=4))
    groups = loaded.config.kv_groups
    windows = [g.window for g in groups if g.window is not None]
    if len(groups) < 2 or not windows:
        raise SystemExit(f"{loaded.config.model_type}: not a hybrid model (KV block groups {groups})")
    window = windows[0]
    full_fraction = sum(len(g.layers) for g in groups if g.window is None) / loaded.config.num_hidden_layers
    rng = random.Random(0)
    rows = []
    for k in multiples:
        length = k * window
        engine = LLMEngine(loaded, EngineConfig(num_blocks=4096, max_num_seqs=batch, max_num_batched_tokens=4096,
                                                enable_prefix_caching=False, max_model_len=length + 16))
        spec = engine.spec
        prompt_len = length // 2
        for i in range(batch):
            engine.add_request(f"h{i}", seeded_prompt(rng, prompt_len, loaded.config.vocab_size),
                               SamplingParams(max_tokens=length - prompt_len + 2, ignore_eos=True))
        last: dict[str, tuple[int, int]] = {}
        while engine.has_unfinished():
            engine.step()
            for seq in engine.scheduler.running:
                last[seq.request_id] = (seq.num_computed_tokens, len(held(seq.block_table)))
        tokens = [t for t, _ in last.values()]
        blocks = [b for _, b in last.values()]
        assert set(tokens) == {length}, tokens  # each sequence's last decode step saw exactly `length` rows
        all_full_blocks = -(-length // spec.block_size_tokens)  # blocks of every layer (num_groups × the bytes)
        hybrid_bytes = sum(blocks) / batch * spec.block_bytes
        all_full_bytes = all_full_blocks * spec.num_groups * spec.block_bytes
        rows.append({
            "tokens": length, "x_window": k,
            "hybrid_blocks_per_seq": sum(blocks) / batch,
            "hybrid_block_bytes": spec.block_bytes,
            "all_full_blocks_per_seq": all_full_blocks,
            "all_full_block_bytes": spec.num_groups * spec.block_bytes,
            "hybrid_kv_bytes_per_token": round(hybrid_bytes / length, 1),
            "all_full_kv_bytes_per_token": round(all_full_bytes / length, 1),
            "hybrid_vs_all_full": round(hybrid_bytes / all_full_bytes, 3),
        })
        engine.check_integrity()
    return {"bench": "hybrid-kv", **machine_label(), "model": loaded.config.model_type, "window": window,
            "full_layer_fraction": full_fraction, "batch": batch, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench hybrid-kv", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a hybrid model dir (default: tiny gpt-oss, window 32)")
    p.add_argument("--multiples", default="1,2,4,8,16", help="sequence lengths as multiples of the window")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    emit(run(model_dir=a.model, multiples=[int(x) for x in a.multiples.split(",")], batch=a.batch), a.out)
    return 0
