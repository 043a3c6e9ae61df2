"""``kvrelay bench decode``: engine decode and prefill throughput vs Hugging Face ``generate`` on the same work.

Same prompts, same output lengths, greedy, measured in one run. Batch 1 runs the requests one after
another; batch 16 submits 16 at once with mixed output lengths. ``transformers`` cannot stop rows of
one ``generate`` call at different lengths, so it runs to the longest and only the tokens each request
asked for are counted (that padding is exactly what continuous batching saves). Prefill: the same
prompts with one output token each (prompt tokens per second; transformers' one-token ``generate`` is
its prefill forward).

``--arch`` benchmarks a tiny model of another family (`kvrelay tiny-model --arch`), e.g. the mixture-of-
experts ones; ``--layers``/``--hidden`` size it. transformers runs SDPA attention where the family has it
(gpt-oss has only eager attention, for its sinks). ``--dtype bfloat16`` runs both in bf16 (kvrelay
through oneDNN's packed bf16 matmuls, as it serves on CPUs with AMX; transformers through ``F.linear``).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from kvrelay.benchmarks.common import emit, ensure_tiny_model, machine_label, seeded_prompt


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


def run(*, model_dir: str | None, prompt_len: int, max_out: int, seed: int, repeats: int = 3,
        arch: str = "llama", shape: dict[str, int] | None = None, dtype: str = "float32") -> dict:
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams
    from transformers import AutoModelForCausalLM

    path = ensure_tiny_model(model_dir, arch=arch, **(shape or {}))
    loaded = load_model(path, dtype=dtype)
    attn = "eager" if loaded.config.attention_sinks else "sdpa"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attn).eval()
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
        pre_ours, pre_theirs = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
            pre_ours.append(time.perf_counter() - t0)
            pre_theirs.append(_hf_generate(hf, prompts, 1, 0))
        prompt_tokens = sum(len(p) for p in prompts)
        results[f"batch_{batch}"] = {
            "output_tokens": useful,
            "kvrelay_tok_per_s": round(useful / ours_s, 1),
            "transformers_tok_per_s": round(useful / hf_s, 1),
            "kvrelay_vs_transformers": round(hf_s / ours_s, 2),
            "prefill_tokens": prompt_tokens,
            "kvrelay_prefill_tok_per_s": round(prompt_tokens / min(pre_ours), 1),
            "transformers_prefill_tok_per_s": round(prompt_tokens / min(pre_theirs), 1),
            "prefill_kvrelay_vs_transformers": round(min(pre_theirs) / min(pre_ours), 2),
        }
    return {"bench": "decode", **machine_label(), "model": path, "arch": loaded.config.model_type, "dtype": dtype,
            "prompt_tokens": prompt_len, "repeats": repeats, "max_output_tokens": max_out,
            "threads": torch.get_num_threads(), **results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir (default: a tiny model)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-out", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", default="llama", help="tiny model family when --model is not given "
                   "(llama, qwen3, qwen3-moe, mixtral, gpt-oss)")
    p.add_argument("--layers", type=int, default=None, help="tiny model layers (default: kvrelay tiny-model's)")
    p.add_argument("--hidden", type=int, default=None, help="tiny model width (default: kvrelay tiny-model's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weights and activations of both engines (bfloat16: what kvrelay serves on CPUs with AMX)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    shape = {k: v for k, v in (("layers", a.layers), ("hidden", a.hidden)) if v is not None}
    emit(run(model_dir=a.model, prompt_len=a.prompt_len, max_out=a.max_out, seed=a.seed, repeats=a.repeats,
             arch=a.arch, shape=shape, dtype=a.dtype), a.out)
    return 0
