"""`CompileBudget`: how much constraint compiling one tenant (API key) may cause on the nodes.

A request whose constraint (`StructuredOutput`) this router has not seen served is *new*: every node it reaches
compiles it first (`engine.grammar`, up to ``engine.grammar_compile_timeout_s`` each, one at a time per node, so
one tenant's new constraints delay every other tenant's). Per tenant:

* at most ``max_concurrent`` new-constraint requests at once (``router.max_compiling_requests_per_tenant``);
* the time during which at least one of them was between placement and its first token (the node compiles in
  there; a refused one counts to its end) at most ``budget_s`` in any ``window_s`` (``router.compile_budget_s``
  per ``router.compile_budget_window_s``). The union, not the sum: a node compiles one constraint at a time, so
  50 requests waiting together on one node's compiles cost that node the span, not 50 times it.

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
    max_concurrent: int = 16
    budget_s: float = 30.0
    window_s: float = 60.0


class CompileBudgetExceeded(Exception):
    """A tenant over its budget: ``message`` (the 429's) names the config key."""


@dataclass(slots=True)
class Claim:
    """One new-constraint request's place in its tenant's budget, given back by `CompileBudget.release`."""

    tenant: bytes
    key: bytes
    ended: bool = False


class CompileBudget:
    """Per-tenant bounds on new-constraint requests (see the module docstring). Event-loop only; not thread-safe.

    ``clock``: seconds since the epoch, the clock of the intervals given to `release` (tests pass their own).
    """

    def __init__(self, config: CompileBudgetConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._tenant_to_running: defaultdict[bytes, int] = defaultdict(int)  # dropped at 0
        self._tenant_to_spent: dict[bytes, deque[tuple[float, float]]] = {}  # (when, seconds), oldest first
        self._tenant_to_charged_until: dict[bytes, float] = {}  # the end of the time already charged

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

    def release(self, claim: Claim, *, start_s: float | None, end_s: float, served: bool) -> None:
        """The claimed request is done with compiling: it was placed at ``start_s`` (None: never placed, nothing
        compiled) and got its first token at ``end_s`` (or ended then without one); ``served``: it got a token
        (its constraint compiled). Charges the part of that interval not charged before. Once per claim."""
        assert not claim.ended, "released twice"
        claim.ended = True
        tenant = claim.tenant
        running = self._tenant_to_running[tenant] - 1
        if running > 0:
            self._tenant_to_running[tenant] = running
        else:
            del self._tenant_to_running[tenant]
        if start_s is not None:
            charged_until = self._tenant_to_charged_until.get(tenant, 0.0)
            seconds = max(0.0, end_s - max(start_s, charged_until))
            self._tenant_to_charged_until[tenant] = max(charged_until, end_s)
            self._tenant_to_spent.setdefault(tenant, deque()).append((self._clock(), seconds))
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
            self._tenant_to_charged_until.pop(tenant, None)
            return 0.0
        return sum(s for _, s in spent)
