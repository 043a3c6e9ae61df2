"""The sampler: greedy, temperature, top-k, top-p, per-request seed (parameters: `model.sampling_params`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.sampling_params import SamplingParams

__all__ = ["SamplingParams", "sample", "sample_one", "token_generator"]


def token_generator(seed: int, index: int, position: int, device: torch.device) -> torch.Generator:
    """The generator for output token ``position`` of sample ``index`` of a request seeded with ``seed``.

    Derived afresh for every token (a SplitMix64-style mix of the three numbers), so a token does not
    depend on which process, step or batch sampled the tokens before it: prefill can sample the first
    token and decode the rest, or a preempted sequence can be recomputed, and the stream is the same.
    """
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) % 2**64
    x ^= x >> 32
    gen = torch.Generator(device=device)
    gen.manual_seed(x % 2**63)
    return gen


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from float32 ``logits`` ``[vocab]``.

    Each row is sampled on its own (not batched) so that a token never depends on which other
    requests share the step.
    """
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = (cum - probs) >= params.top_p  # keep the smallest set reaching top_p; the top token always stays
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """One token per row of ``logits`` ``[N, vocab]`` with that row's params and generator."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy_rows:
        picked = torch.argmax(logits[greedy_rows], dim=-1).tolist()
        for row, tok in zip(greedy_rows, picked):
            out[row] = tok
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, generators[i])
    return out
