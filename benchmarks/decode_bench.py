"""``kvrelay bench decode``: engine decode throughput vs Hugging Face ``generate`` on the same work.

Same prompts, same output lengths, greedy, measured in one run. Batch 1 runs the requests one after
another; batch 16 submits 16 at once with mixed output lengths. ``transformers`` cannot stop rows of
one ``generate`` call at different lengths, so it runs to the longest and only the tokens each request
asked for are counted (that padding is exactly what continuous batching saves).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import emit, ensure_tiny_model, machine_label, seeded_prompt


def _hf_generate(hf_model: torch.nn.Module, prompts: list[list[int]], max_new: int, pad_id: int) -> float:
    """Left-padded batched greedy generate; returns seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0


def run(*, model_dir: str | None, prompt_len: int, max_out: int, seed: int, repeats: int = 3) -> dict:
    from transformers import AutoModelForCausalLM

    from engine.engine import EngineConfig, LLMEngine
    from model.loader import load_model
    from model.sampling import SamplingParams

    path = ensure_tiny_model(model_dir)
    loaded = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    vocab = loaded.config.vocab_size
    rng = random.Random(seed)
    results: dict[str, dict] = {}
    for batch in (1, 16):
        prompts = [seeded_prompt(rng, prompt_len, vocab) for _ in range(batch)]
        outs = [max_out if batch == 1 else rng.randint(max_out // 4, max_out) for _ in range(batch)]
        useful = sum(outs)
        engine = LLMEngine(loaded, EngineConfig(num_blocks=2048, enable_prefix_caching=False))
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        _hf_generate(hf, prompts[:1], 2, 0)  # warm-up
        ours, theirs = [], []
        for _ in range(repeats):  # interleaved, best of each: the machine is shared and noisy
            t0 = time.perf_counter()
            engine.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs])
            ours.append(time.perf_counter() - t0)
            theirs.append(_hf_generate(hf, prompts, max(outs), 0))
        ours_s, hf_s = min(ours), min(theirs)
        results[f"batch_{batch}"] = {
            "output_tokens": useful,
            "kvrelay_tok_per_s": round(useful / ours_s, 1),
            "transformers_tok_per_s": round(useful / hf_s, 1),
            "kvrelay_vs_transformers": round(hf_s / ours_s, 2),
        }
    return {"bench": "decode", **machine_label(), "model": path, "prompt_tokens": prompt_len, "repeats": repeats,
            "max_output_tokens": max_out, "threads": torch.get_num_threads(), **results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny model)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-out", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    emit(run(model_dir=a.model, prompt_len=a.prompt_len, max_out=a.max_out, seed=a.seed), a.out)
    return 0
