"""vLLM's ``prompt_logprobs`` in its answer's shape: a list with one entry per prompt token, ``None`` for the first
(nothing precedes it) and for each later token a map from token id (a string, as JSON keys are) to ``{"logprob",
"rank", "decoded_token"}`` holding the prompt's token and the top alternatives the request asked for::

    "prompt_logprobs": [null, {"42": {"logprob": -3.1, "rank": 7, "decoded_token": " cat"},
                               "11": {"logprob": -0.4, "rank": 1, "decoded_token": " the"}, ...}, ...]

The prompt's token comes first; a top alternative that is the prompt's token replaces its entry in place with its
rank among the top (vLLM builds the map the same way). A ``-inf`` logprob is answered as ``-9999.0`` (vLLM's
``clamp_prompt_logprobs``: JSON has no infinity). Completions put the list on each choice
(``choices[i].prompt_logprobs``, its prompt's), chat on the answer (``prompt_logprobs``).
"""

from __future__ import annotations

import math
from typing import Any

from kvrelay.model.sampling_params import PromptTokenLogprobs
from kvrelay.model.tokenizer import Tokenizer

CLAMPED_LOGPROB = -9999.0  # vLLM's stand-in for -inf


def prompt_logprobs_body(tokenizer: Tokenizer | None, prompt_token_ids: list[int],
                         entries: list[PromptTokenLogprobs]) -> list[dict[str, dict[str, Any]] | None]:
    """The ``prompt_logprobs`` list of a prompt of P tokens from its P - 1 entries (`PromptTokenLogprobs`, positions
    1 to P - 1). ``decoded_token``: each token's text on its own (special tokens kept, as vLLM's); None without a
    tokenizer.

    Raises:
        ValueError: not one entry per prompt token after the first.
    """
    if len(entries) != len(prompt_token_ids) - 1:
        raise ValueError(f"{len(entries)} prompt logprobs for a prompt of {len(prompt_token_ids)} tokens")
    texts: dict[int, str | None] = {}

    def text(tok: int) -> str | None:
        if tok not in texts:
            texts[tok] = None if tokenizer is None else tokenizer.decode([tok], skip_special_tokens=False)
        return texts[tok]

    def one(tok: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob if logprob != -math.inf else CLAMPED_LOGPROB, "rank": rank,
                "decoded_token": text(tok)}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for tok, entry in zip(prompt_token_ids[1:], entries, strict=True):
        position = {str(tok): one(tok, entry.logprob, entry.rank)}
        for rank, (t, v) in enumerate(entry.top, start=1):
            position[str(t)] = one(t, v, rank)
        out.append(position)
    return out


def add_prompt_logprobs(body: dict[str, Any], kind: str,
                        choice_lists: list[list[dict[str, dict[str, Any]] | None] | None]) -> None:
    """Put each choice's prompt's ``prompt_logprobs`` (``choice_lists[i]``, by choice index; None: not asked) into
    the answer ``body``: on each choice of a completion, on the answer of a chat (its one prompt's). Mutates
    ``body``."""
    if kind == "chat":
        if choice_lists and choice_lists[0] is not None:
            body["prompt_logprobs"] = choice_lists[0]
        return
    for choice, lists in zip(body["choices"], choice_lists, strict=True):
        if lists is not None:
            choice["prompt_logprobs"] = lists
