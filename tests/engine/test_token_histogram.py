"""Issue 64: the engine's tokens-per-step histogram (exported as vLLM's ``vllm:iteration_tokens_total``)."""

from __future__ import annotations

import pytest
from kvrelay.engine.token_histogram import ITERATION_TOKEN_BUCKETS, TokenCounts, TokenHistogram


def test_each_step_falls_in_the_first_bucket_whose_bound_holds_it() -> None:
    h = TokenHistogram()
    for n in (0, 1, 2, 8, 9, 16384, 16385):
        h.observe(n)
    counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    counts[0], counts[1], counts[2], counts[12], counts[13] = 2, 2, 1, 1, 1  # ≤1: 0, 1; ≤8: 2, 8; ≤16: 9; ...
    assert h.snapshot() == TokenCounts(tuple(counts), 0 + 1 + 2 + 8 + 9 + 16384 + 16385, ITERATION_TOKEN_BUCKETS)


def test_bounds_must_increase() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        TokenHistogram(bounds=(1, 8, 8))
    with pytest.raises(ValueError, match="strictly increasing"):
        TokenHistogram(bounds=())
