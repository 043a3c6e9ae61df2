"""`CompileBudget`: how much constraint compiling one tenant (API key) may cause on the nodes.

A request whose constraint (`StructuredOutput`) this router has not seen served is *new*: every node it reaches
compiles it first (`engine.grammar`, up to ``engine.grammar_compile_timeout_s`` each, one at a time per node, so
one tenant's new constraints delay every other tenant's). Per tenant:

* at most ``max_concurrent`` new-constraint requests at once (``router.max_compiling_requests_per_tenant``);
* their seconds from placement to first token (the node's compile is in it; a refused one counts to its end) at
  most ``budget_s`` in any ``window_s`` (``router.compile_budget_s`` per ``router.compile_budget_window_s``).

Past either, a 429 naming the key. A constraint is *seen* once a request carrying it got its first token; seen
constraints (the last `MAX_SEEN`) cost nothing here (the nodes have it compiled, or compile it within the
deadline they already met once).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.model.structured import StructuredOutput

MAX_SEEN = 4096  # constraints remembered as served (32 bytes each)


@dataclass(frozen=True, slots=True)
class CompileBudgetConfig:
    max_concurrent: int = 2
    budget_s: float = 30.0
    window_s: float = 60.0


class CompileBudgetExceeded(Exception):
    """A tenant over its budget: ``message`` (the 429's) names the config key."""


@dataclass(slots=True)
class Claim:
    """One new-constraint request's place in its tenant's budget, given back by `CompileBudget.release`."""

    tenant: bytes
    key: bytes


class CompileBudget:
    """Per-tenant bounds on new-constraint requests (see the module docstring). Event-loop only; not thread-safe.

    ``clock``: seconds, monotonic (tests pass their own).
    """

    def __init__(self, config: CompileBudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._tenant_to_running: defaultdict[bytes, int] = defaultdict(int)  # dropped at 0
        self._tenant_to_spent: dict[bytes, deque[tuple[float, float]]] = {}  # (when, seconds), oldest first

    def claim(self, tenant: bytes, out: StructuredOutput | None) -> Claim | None:
        """A place for a request of ``tenant`` constrained by ``out``; None when it needs none (no constraint, or
        one seen served).

        Raises:
            CompileBudgetExceeded: the tenant has ``max_concurrent`` new-constraint requests running, or spent its
                seconds in the window.
        """
        if out is None:
            return None
        key = hashlib.sha256(repr(out.cache_key).encode()).digest()
        if key in self._seen:
            self._seen.move_to_end(key)
            return None
        cfg = self.config
        running = self._tenant_to_running.get(tenant, 0)
        if running >= cfg.max_concurrent:
            raise CompileBudgetExceeded(
                f"this API key has {running} requests with constraints the nodes have not compiled before running, "
                f"its limit (router.max_compiling_requests_per_tenant); retry when they are done")
        spent = self.spent_s(tenant)
        if spent >= cfg.budget_s:
            raise CompileBudgetExceeded(
                f"this API key's requests with new constraints took {spent:.1f} s to their first token in the last "
                f"{cfg.window_s:g} s, its budget (router.compile_budget_s); retry later")
        self._tenant_to_running[tenant] = running + 1
        return Claim(tenant, key)

    def release(self, claim: Claim, *, seconds: float, served: bool) -> None:
        """The claimed request is done with compiling: it took ``seconds`` (placement to first token, or to its end
        without one); ``served``: it got a token (its constraint compiled)."""
        running = self._tenant_to_running[claim.tenant] - 1
        if running > 0:
            self._tenant_to_running[claim.tenant] = running
        else:
            del self._tenant_to_running[claim.tenant]
        self._tenant_to_spent.setdefault(claim.tenant, deque()).append((self._clock(), max(0.0, seconds)))
        if served:
            self._seen[claim.key] = None
            self._seen.move_to_end(claim.key)
            while len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)

    def spent_s(self, tenant: bytes) -> float:
        """The seconds ``tenant``'s new-constraint requests took within the window."""
        spent = self._tenant_to_spent.get(tenant)
        if spent is None:
            return 0.0
        since = self._clock() - self.config.window_s
        while spent and spent[0][0] < since:
            spent.popleft()
        if not spent:
            del self._tenant_to_spent[tenant]
            return 0.0
        return sum(s for _, s in spent)
