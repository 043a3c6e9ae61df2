"""vLLM's ``prompt_logprobs``: the log-probability of each prompt token given the tokens before it.

A prefill step computes logits only where a sequence samples (its last prompt row). For a sequence whose request
asked for its prompt's logprobs (`wants_prompt_logprobs`), the runner also turns the hidden states of every row of
its prefill chunk into logprobs (`chunk_prompt_logprobs`), at most `LOGITS_ROWS` rows of logits at a time, so a
long chunk never holds ``[chunk, vocab]`` float32 logits at once::

    prompt:      t0   t1   t2   t3   t4          (P = 5 prompt tokens)
    chunk rows:  p0   p1   p2 | p3   p4          (two chunks: [0, 3) and [3, 5))
    entries:     None e1   e2   e3   e4          e_i = log_softmax(logits(p_{i-1}))[t_i]
                      └ chunk 1 ┘└ chunk 2 ┘     (p4's logits pick the first output token, not an entry)

Such a prompt is computed in full: its prefix is not matched against the prefix cache (`engine.scheduler`), since a
cached block's rows have no logits (as vLLM, which skips the prefix cache for such requests). Nothing here runs for
any other sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvrelay.engine.sequence import Sequence
from kvrelay.model.sampling_params import PromptTokenLogprobs

LOGITS_ROWS = 256  # rows of [rows, vocab] float32 logits at once (a 152k vocabulary: 156 MB)


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether ``seq``'s prefill computes its prompt's logprobs: its request asked (``params.prompt_logprobs``)
    and it is prefilling the prompt itself — not a sequence that arrived with output tokens (a decode node's
    request prefilled elsewhere, a resumed or forked sample), whose prompt logprobs were computed where its
    prompt was."""
    return seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0


@dataclass(frozen=True, slots=True)
class ChunkPromptLogprobs:
    """The prompt logprobs one prefill chunk of ``seq`` produced: ``entries[j]`` is prompt position
    ``first_position + j`` (≥ 1; position 0 has none)."""

    seq: Sequence
    first_position: int
    entries: list[PromptTokenLogprobs]


def chunk_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, seq: Sequence, *, start: int,
                          num_top: int) -> ChunkPromptLogprobs:
    """The prompt logprobs of the chunk of ``seq`` whose rows are positions ``[start, start + hidden.shape[0])``.

    Args:
        model: has ``compute_logits([N, hidden_size]) -> float32 [N, vocab]``.
        hidden: ``[chunk, hidden_size]``: the model's final hidden states of the chunk's rows, in position order.
        seq: the sequence (`wants_prompt_logprobs`); only its prompt tokens are read.
        start: the chunk's first position.
        num_top: top alternatives per position (0: only the prompt's token; -1: the whole vocabulary).

    Row ``p`` gives the entry of position ``p + 1``; a row at the last prompt position gives none.
    """
    num_prompt = seq.num_prompt_tokens
    rows = max(0, min(hidden.shape[0], num_prompt - 1 - start))
    entries: list[PromptTokenLogprobs] = []
    targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + rows], dtype=torch.int64, device=hidden.device)
    for lo in range(0, rows, LOGITS_ROWS):
        hi = min(rows, lo + LOGITS_ROWS)
        logprobs = torch.log_softmax(model.compute_logits(hidden[lo:hi]).float(), dim=-1)
        token = logprobs.gather(1, targets[lo:hi, None])
        ranks = (logprobs >= token).sum(dim=-1)  # vLLM's rank: ties count against the token
        if num_top != 0:
            top = torch.topk(logprobs, logprobs.shape[-1] if num_top < 0 else num_top, dim=-1)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        else:
            top_ids = top_values = [[] for _ in range(hi - lo)]
        entries.extend(PromptTokenLogprobs(v, r, tuple(zip(ids, vals, strict=True)))
                       for v, r, ids, vals in zip(token[:, 0].tolist(), ranks.tolist(), top_ids, top_values,
                                                  strict=True))
    return ChunkPromptLogprobs(seq, start + 1, entries)
