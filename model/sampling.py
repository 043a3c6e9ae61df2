"""The sampler: min_tokens, logit bias, penalties, then greedy or temperature, min-p, top-k, top-p, with a
per-request seed (parameters: `model.sampling_params`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from kvrelay.model.sampling_params import SamplingParams, TokenLogprobs

__all__ = ["History", "SamplingParams", "TokenLogprobs", "adjust_logits", "sample", "sample_one", "sampling_scores",
           "token_generator", "token_logprobs"]


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


History = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, output token ids) of one sample


def adjust_logits(row: torch.Tensor, params: SamplingParams, history: History,
                  eos_token_ids: Collection[int]) -> None:
    """Apply ``params``' allowed_token_ids, bad words, min_tokens, logit_bias and penalties to one float32 row
    ``[vocab]`` in place (the order and meaning are `SamplingParams`').

    A mask that would leave no token at all (every logit -inf: nothing could be drawn, and greedy would pick
    token 0) is not applied: what came before it wins (a grammar over allowed_token_ids, those over a bad word,
    any of them over min_tokens' hold on the stop tokens).
    """
    prompt, output = history
    vocab = row.shape[-1]
    if params.allowed_token_ids is not None:
        keep = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=row.device)
        masked = torch.full_like(row, float("-inf"))
        masked[keep] = row[keep]
        if bool(torch.isfinite(masked).any()):
            row.copy_(masked)
    if params.bad_words_token_ids:
        tail = list(output)
        _ban(row, [w[-1] for w in params.bad_words_token_ids
                   if w[-1] < vocab and (len(w) == 1 or (len(tail) >= len(w) - 1
                                                         and tail[len(tail) - len(w) + 1:] == list(w[:-1])))])
    if len(output) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        _ban(row, [t for t in stops if 0 <= t < vocab])
    if params.logit_bias:
        pairs = [(t, b) for t, b in params.logit_bias if 0 <= t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in pairs], dtype=row.dtype, device=row.device))
    if params.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.unique(torch.tensor([*prompt, *output], device=row.device))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output), device=row.device), minlength=vocab)[:vocab].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _ban(row: torch.Tensor, ids: list[int]) -> None:
    """Set ``row[ids]`` to -inf in place, unless that leaves no finite logit (then ``row`` is left as it was)."""
    if not ids:
        return
    saved = row[ids].clone()
    row[ids] = float("-inf")
    if not bool(torch.isfinite(row).any()):
        row[ids] = saved


def sampling_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores a token is drawn from, ``[vocab]`` float32: the (adjusted) logits over the temperature,
    with the tokens min_p, top-k and top-p leave out at -inf. Greedy: the logits as they are."""
    scores = logits.float()
    if params.greedy:
        return scores
    scores = scores / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
    return scores


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from float32 ``logits`` ``[vocab]`` (already adjusted: `adjust_logits`).

    Each row is sampled on its own (not batched) so that a token never depends on which other
    requests share the step.
    """
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(sampling_scores(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(logits: torch.Tensor, params: SamplingParams, token: int) -> TokenLogprobs:
    """``token``'s logprob and the top ``params.logprobs`` alternatives that could have been drawn: a token top-k,
    top-p, min-p or a grammar ruled out (-inf) is none (and -inf is no JSON number)."""
    logp = torch.log_softmax(sampling_scores(logits, params), dim=-1)
    k = min(params.logprobs or 0, int(torch.isfinite(logp).sum()))
    top = torch.topk(logp, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
    return TokenLogprobs(float(logp[token]), pairs)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
    histories: Sequence[History | None] | None = None, eos_token_ids: Collection[int] = (),
    argmax: Sequence[int] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of ``logits`` ``[N, vocab]`` with that row's params and generator, and its
    `TokenLogprobs` for the rows whose params ask for logprobs (else None).

    ``histories[i]`` is needed for each row whose params adjust the logits (`SamplingParams.adjusts_logits`);
    ``eos_token_ids`` are the stop tokens ``min_tokens`` holds back (with ``stop_token_ids``). ``argmax``: each
    row's ``torch.argmax`` of ``logits`` where the caller has it already (`engine.model_runner.StepLogits.greedy`):
    a greedy row whose params do not adjust its logits takes it instead of a search of its own.
    """
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjusted:
        assert histories is not None, "a row adjusts its logits: pass histories"
        logits = logits.float().clone()
        for i in adjusted:
            history = histories[i]
            assert history is not None
            adjust_logits(logits[i], params[i], history, eos_token_ids)
    out = [0] * len(params)
    if argmax is not None:  # the rows whose logits no adjustment moved
        for i, p in enumerate(params):
            if p.greedy and not p.adjusts_logits:
                out[i] = argmax[i]
    greedy_rows = [i for i, p in enumerate(params) if p.greedy and (argmax is None or p.adjusts_logits)]
    if greedy_rows:
        greedy = logits if len(greedy_rows) == logits.shape[0] else logits[greedy_rows]  # every row: no copy
        picked = torch.argmax(greedy, dim=-1).tolist()
        for row, tok in zip(greedy_rows, picked):
            out[row] = tok
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, generators[i])
    logprobs = [None if p.logprobs is None else token_logprobs(logits[i], p, out[i]) for i, p in enumerate(params)]
    return out, logprobs
