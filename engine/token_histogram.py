"""`TokenHistogram`: how many tokens each engine step computed, counted into fixed buckets with plain ints.

The engine thread is its only writer (`LLMEngine.step`); a node reads a `snapshot` at each scrape and exports it
as vLLM's ``vllm:iteration_tokens_total`` histogram (`node.vllm_metrics`). Plain ints rather than a Prometheus
object, so that the engine needs no registry and the node chooses names and labels.

    bounds  (1, 8, 16, ..., 16384)       upper bounds, inclusive (Prometheus ``le``)
    counts  [c_1, c_8, ..., c_16384, c_inf]   steps whose token count fell in each bucket, not cumulative
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

# vLLM's buckets for vllm:iteration_tokens_total (vllm/v1/metrics/loggers.py)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class TokenCounts(NamedTuple):
    """A copy of a `TokenHistogram`: per-bucket counts (not cumulative; the last is above every bound), the sum
    of the observed token counts, and the bounds."""

    counts: tuple[int, ...]
    total_tokens: int
    bounds: tuple[int, ...]


@dataclass(slots=True)
class TokenHistogram:
    """Steps by the number of tokens they computed (prefill chunk tokens plus one per decode row).

    Only the engine thread calls `observe`; `snapshot` may be called from any thread (a scrape racing a step
    may see that step's count without its sum, or the other way round: off by one step, never torn ints)."""

    bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS
    counts: list[int] = field(default_factory=list)  # len(bounds) + 1; filled in __post_init__
    total_tokens: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)) or not self.bounds:
            raise ValueError(f"bounds must be strictly increasing and non-empty, got {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, num_tokens: int) -> None:
        """Count one step of ``num_tokens`` tokens (≥ 0) into the first bucket whose bound is ≥ it."""
        self.counts[bisect.bisect_left(self.bounds, num_tokens)] += 1
        self.total_tokens += num_tokens

    def snapshot(self) -> TokenCounts:
        return TokenCounts(tuple(self.counts), self.total_tokens, self.bounds)
