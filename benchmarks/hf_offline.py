"""The offline ``transformers`` baseline: ``generate`` in fixed batches over the same prompts, for throughput.

Greedy, left-padded, ``min_new_tokens = max_new_tokens`` = the longest output the batch asked for (the
same exact lengths ``ignore_eos`` gives the server). Only the tokens each request asked for count as
output: the padding a static batch decodes past shorter requests is what continuous batching saves.
No server, no streaming: the numbers are throughput only (``request_throughput``, ``output_throughput``,
``total_token_throughput`` as in `benchmarks.serve_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from kvrelay.benchmarks.serve_client import RequestSpec


def run_transformers(model_dir: str, requests: Sequence[RequestSpec], *, batch_size: int = 16,
                     pad_token_id: int = 0) -> dict[str, Any]:
    """Generate every request's output in batches of ``batch_size`` and time it (one warm-up first).

    Raises:
        ValueError: no requests, or ``batch_size`` < 1.
    """
    from transformers import AutoModelForCausalLM

    if not requests or batch_size < 1:
        raise ValueError(f"need requests and batch_size >= 1 (got {len(requests)} requests, batch {batch_size})")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _generate(model, [list(requests[0].prompt_token_ids)], 2, pad_token_id)
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        _generate(model, [list(r.prompt_token_ids) for r in batch], max(r.max_tokens for r in batch), pad_token_id)
    duration = time.perf_counter() - t0
    total_in = sum(len(r.prompt_token_ids) for r in requests)
    total_out = sum(r.max_tokens for r in requests)
    return {
        "baseline": "transformers", "batch_size": batch_size, "duration": duration, "completed": len(requests),
        "failed": 0, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(requests) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "torch_threads": torch.get_num_threads(),
    }


def _generate(model: torch.nn.Module, prompts: list[list[int]], max_new: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                       do_sample=False, pad_token_id=pad_id)
