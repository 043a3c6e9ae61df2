"""Serving workloads as token-id prompts, so every server sees identical work.

=============  ==============================================================================================
name           requests
=============  ==============================================================================================
shared-prefix  G groups × P prompts: group g's system prompt (S tokens) + a question (Q tokens); O output
               tokens; order shuffled (seeded). Ideal hit rate ≈ (P − 1)/P of the system-prompt blocks.
multi-round    U users × R rounds: one shared system prompt (S) + a first question (Q); each later round
               sends the previous prompt + the server's reply (re-tokenized text) + a new question (Q).
trace          Mooncake conversation trace replay: each 512-token trace block (hash id) becomes a fixed
               run of ``block_tokens`` token ids (same id → same tokens); input and output lengths scaled by
               block_tokens / 512; a window of requests; arrival times divided by ``time_compression``.
random         N prompts of ``input_len`` (± ``range_ratio``) random tokens, O output tokens.
=============  ==============================================================================================

All randomness comes from ``seed``, in a stream of its own per workload (two workloads never share
tokens by accident, so runs on one server do not warm each other); token ids are drawn from ``[0, vocab)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.benchmarks.common import read_trace
from kvrelay.benchmarks.offline_cache import CachedRequest
from kvrelay.benchmarks.serve_client import FollowUp, RequestRecord, RequestSpec

TRACE_BLOCK_TOKENS = 512
Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class Workload:
    """A workload ready to send.

    Attributes:
        name: one of ``WORKLOADS``.
        params: every choice that shaped the requests (written into the result JSON).
        requests: the requests known up front (multi-round: the first round).
        follow_up: builds the next request from a finished one (multi-round), else None.
        expected_total: requests including follow-ups, for the progress bar.
        encode: the tokenizer, when replies become prompt tokens (multi-round).
    """

    name: str
    params: dict[str, Any]
    requests: list[RequestSpec]
    follow_up: FollowUp | None = None
    expected_total: int = 0
    encode: Encode | None = field(default=None, repr=False)

    def cached_requests(self, records: list[RequestRecord], *, replies_cached: bool) -> list[CachedRequest]:
        """The replay sequence for `benchmarks.offline_cache`, in send order.

        ``replies_cached``: the measured node also computed the replies (it decodes), so their blocks count
        as cached when ``encode`` knows their tokens; a prefill node only ever computes prompts.
        """
        out = []
        for r in records:
            prompt = r.spec.prompt_token_ids
            known = replies_cached and self.encode is not None and r.success
            computed = prompt + tuple(self.encode(r.generated_text)) if known and self.encode else None
            out.append(CachedRequest(prompt, computed))
        return out


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def shared_prefix(*, groups: int, prompts_per_group: int, system_tokens: int, question_tokens: int,
                  output_tokens: int, seed: int = 0, vocab: int = 256) -> Workload:
    """G × P prompts sharing one system prompt per group (see the module table)."""
    rng = random.Random(f"shared-prefix/{seed}")
    systems = [_tokens(rng, system_tokens, vocab) for _ in range(groups)]
    specs = [RequestSpec(systems[g] + _tokens(rng, question_tokens, vocab), output_tokens, conversation=g)
             for g in range(groups) for _ in range(prompts_per_group)]
    rng.shuffle(specs)
    params = {"groups": groups, "prompts_per_group": prompts_per_group, "system_tokens": system_tokens,
              "question_tokens": question_tokens, "output_tokens": output_tokens, "seed": seed}
    return Workload("shared-prefix", params, specs, expected_total=len(specs))


def multi_round(*, users: int, rounds: int, system_tokens: int, question_tokens: int, output_tokens: int,
                encode: Encode, max_prompt_tokens: int, seed: int = 0, vocab: int = 256) -> Workload:
    """U conversations of up to R rounds; a conversation ends early when its next prompt plus the reply
    would pass ``max_prompt_tokens + output_tokens`` (so it always fits the model's context)."""
    rng = random.Random(f"multi-round/{seed}")
    system = _tokens(rng, system_tokens, vocab)

    def question(user: int, turn: int) -> tuple[int, ...]:
        return _tokens(random.Random(f"multi-round/{seed}/{user}/{turn}"), question_tokens, vocab)

    first = [RequestSpec(system + question(u, 0), output_tokens, conversation=u, turn=0) for u in range(users)]

    def follow_up(spec: RequestSpec, record: RequestRecord) -> RequestSpec | None:
        turn = spec.turn + 1
        if turn >= rounds:
            return None
        prompt = spec.prompt_token_ids + tuple(encode(record.generated_text)) + question(spec.conversation, turn)
        if len(prompt) > max_prompt_tokens:
            return None
        return RequestSpec(prompt, output_tokens, conversation=spec.conversation, turn=turn)

    params = {"users": users, "rounds": rounds, "system_tokens": system_tokens, "question_tokens": question_tokens,
              "output_tokens": output_tokens, "max_prompt_tokens": max_prompt_tokens, "seed": seed,
              "reply_tokens": "server reply text, re-tokenized with the model's tokenizer"}
    return Workload("multi-round", params, first, follow_up, users * rounds, encode)


def trace(*, start: int = 0, num_requests: int = 200, block_tokens: int = 16, time_compression: float = 1.0,
          max_prompt_tokens: int = 2000, max_output_tokens: int = 64, seed: int = 0, vocab: int = 256,
          path: str | None = None) -> Workload:
    """Replay ``num_requests`` trace requests from index ``start`` (see the module table).

    Scaled lengths: input ``ceil(input_length · block_tokens / 512)`` tokens, cut to ``max_prompt_tokens``
    (a cut keeps the leading blocks, so prefix sharing is unchanged); output
    ``clamp(round(output_length · block_tokens / 512), 1, max_output_tokens)``. Arrival of request i:
    ``(timestamp_i − timestamp_start) / 1000 / time_compression`` seconds.

    Raises:
        ValueError: the window is empty, or ``time_compression`` <= 0.
    """
    if time_compression <= 0:
        raise ValueError(f"time_compression must be positive, got {time_compression}")
    rows = list(read_trace(path, limit=start + num_requests))[start:]
    if not rows:
        raise ValueError(f"trace window [{start}, {start + num_requests}) is empty")
    scale = block_tokens / TRACE_BLOCK_TOKENS
    hash_to_tokens: dict[int, tuple[int, ...]] = {}
    specs = []
    cut = 0
    t0 = rows[0].timestamp_ms
    for row in rows:
        tokens: list[int] = []
        for h in row.hash_ids:
            if h not in hash_to_tokens:
                hash_to_tokens[h] = _tokens(random.Random(f"trace/{seed}/{h}"), block_tokens, vocab)
            tokens.extend(hash_to_tokens[h])
        length = max(1, math.ceil(row.input_length * scale))
        if length > max_prompt_tokens:
            cut += 1
            length = max_prompt_tokens
        out = min(max_output_tokens, max(1, round(row.output_length * scale)))
        arrival = (row.timestamp_ms - t0) / 1000.0 / time_compression
        specs.append(RequestSpec(tuple(tokens[:length]), out, arrival_s=arrival))
    params = {"trace": "mooncake conversation_trace.jsonl", "start": start, "num_requests": len(rows),
              "block_tokens": block_tokens, "length_scale": f"{TRACE_BLOCK_TOKENS} trace tokens -> {block_tokens}",
              "time_compression": time_compression, "max_prompt_tokens": max_prompt_tokens,
              "max_output_tokens": max_output_tokens, "prompts_cut": cut, "seed": seed,
              "trace_span_s": (rows[-1].timestamp_ms - t0) / 1000.0}
    return Workload("trace", params, specs, expected_total=len(specs))


def random_prompts(*, num_requests: int, input_tokens: int, output_tokens: int, range_ratio: float = 0.0,
                   seed: int = 0, vocab: int = 256) -> Workload:
    """Independent random prompts, lengths uniform in ``input_tokens · [1 − r, 1 + r]``."""
    rng = random.Random(f"random/{seed}")
    lo = max(1, int(input_tokens * (1 - range_ratio)))
    hi = max(lo, int(input_tokens * (1 + range_ratio)))
    specs = [RequestSpec(_tokens(rng, rng.randint(lo, hi), vocab), output_tokens) for _ in range(num_requests)]
    params = {"num_requests": num_requests, "input_tokens": input_tokens, "output_tokens": output_tokens,
              "range_ratio": range_ratio, "seed": seed}
    return Workload("random", params, specs, expected_total=len(specs))


WORKLOADS = ("shared-prefix", "multi-round", "trace", "random")
