"""Per-tenant bounds on requests whose constraint the nodes have not compiled before (`router.compile_budget`):
at most K at once, and their seconds to first token per window; past either, the 429's text names the key."""

from __future__ import annotations

import pytest
from kvrelay.model.structured import StructuredOutput
from kvrelay.router.compile_budget import CompileBudget, CompileBudgetConfig, CompileBudgetExceeded

A, B = b"tenant-a", b"tenant-b"


def grammar(i: int) -> StructuredOutput:
    return StructuredOutput("grammar", f'root ::= "{i}"')


def test_k_new_constraints_at_once_per_tenant_and_seen_ones_are_free():
    budget = CompileBudget(CompileBudgetConfig(max_concurrent=2, budget_s=100.0, window_s=60.0), clock=lambda: 1.0)
    assert budget.claim(A, None) is None
    first, second = budget.claim(A, grammar(1)), budget.claim(A, grammar(2))
    assert first is not None and second is not None
    with pytest.raises(CompileBudgetExceeded, match=r"^this API key has 2 requests with constraints the nodes have "
                                                    r"not compiled before running, its limit "
                                                    r"\(router.max_compiling_requests_per_tenant\)"):
        budget.claim(A, grammar(3))
    assert budget.claim(B, grammar(3)) is not None  # another tenant's own count
    budget.release(first, start_s=0.0, end_s=0.5, served=True)
    assert budget.claim(A, grammar(1)) is None  # seen served: no compile, no place taken
    assert budget.claim(A, grammar(3)) is not None  # the released place
    budget.release(second, start_s=0.0, end_s=0.5, served=False)
    assert budget.claim(A, grammar(2)) is not None  # refused ones are not seen


def test_the_time_compiling_per_window_per_tenant_counts_overlaps_once():
    now = [100.0]
    budget = CompileBudget(CompileBudgetConfig(max_concurrent=8, budget_s=10.0, window_s=60.0), clock=lambda: now[0])
    claims = [budget.claim(A, grammar(i)) for i in range(3)]
    assert None not in claims
    budget.release(claims[0], start_s=100.0, end_s=104.0, served=True)  # 4 s
    budget.release(claims[1], start_s=101.0, end_s=106.0, served=True)  # 2 s more: 101-104 was charged
    now[0] = 110.0
    budget.release(claims[2], start_s=None, end_s=110.0, served=False)  # never placed: nothing compiled
    assert budget.spent_s(A) == 6.0
    claim = budget.claim(A, grammar(4))
    assert claim is not None
    budget.release(claim, start_s=107.0, end_s=111.0, served=False)  # e.g. a compile killed at its deadline
    assert budget.spent_s(A) == 10.0 and budget.spent_s(B) == 0.0
    with pytest.raises(CompileBudgetExceeded, match=r"^this API key's requests with new constraints took 10.0 s to "
                                                    r"their first token in the last 60 s, its budget "
                                                    r"\(router.compile_budget_s\)"):
        budget.claim(A, grammar(2))
    assert budget.claim(B, grammar(2)) is not None
    now[0] = 175.5  # the spend left the window
    assert budget.spent_s(A) == 0.0 and budget.claim(A, grammar(2)) is not None
