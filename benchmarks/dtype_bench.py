"""``kvrelay bench dtype``: what serving in bf16 costs in accuracy — greedy agreement with float32.

The same engine runs the same prompts twice, weights and KV in float32 and in bfloat16 (what
``dtype: auto`` picks on this CPU), greedy, ``--new-tokens`` each. Reported: the fraction of prompts
whose whole output is identical, the mean fraction of each output that matches before the first
difference, and the mean top-1 agreement per position (after a difference the contexts differ, so
this one is only indicative). Prompts are chat-templated questions, as users send them.

    kvrelay bench dtype --model .models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
from typing import Any

from kvrelay.benchmarks.common import emit, machine_label

TOPICS = ["the moon", "bread", "volcanoes", "the Roman empire", "photosynthesis", "chess", "rainbows", "bees",
          "the internet", "glaciers", "music", "electricity", "the ocean", "coffee", "trains", "mathematics"]
ASKS = ["Explain {} in two sentences.", "Give me three facts about {}."]


def prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` chat-templated questions as token ids."""
    out = []
    for i in range(count):
        text = ASKS[i // len(TOPICS) % len(ASKS)].format(TOPICS[i % len(TOPICS)])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out


def run(model_dir: str, *, count: int, new_tokens: int) -> dict[str, Any]:
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams
    from kvrelay.model.tokenizer import load_tokenizer

    ids = prompts(load_tokenizer(model_dir), count)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(load_model(model_dir, dtype=dtype), EngineConfig(num_blocks=1024))
        outs[dtype] = [o[0] for o in engine.generate(ids, params)]
    prefix, positional, identical = [], [], 0
    for a, b in zip(outs["float32"], outs["bfloat16"]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(same / len(a))
        positional.append(sum(x == y for x, y in zip(a, b)) / len(a))
        identical += same == len(a)
    return {"prompts": count, "new_tokens": new_tokens, "identical_outputs_frac": identical / count,
            "mean_agreeing_prefix_frac": sum(prefix) / count, "mean_positional_agreement": sum(positional) / count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench dtype", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {"bench": "dtype", "model": args.model, **run(args.model, count=args.prompts,
                                                           new_tokens=args.new_tokens), **machine_label()}
    emit(result, args.out)
    return 0
