"""Where a block enters a tier's eviction order: the ``kvstore.<tier>.policy`` of each tier.

Every tier evicts its least recently used block first; a policy decides where a *new* block enters:

* ``lru``: at the most recently used end, always (what vLLM, SGLang and LMCache do).
* ``cold-tail`` (the default): a request's blocks (prompt and output) more than ``M`` past its cached
  prefix are *cold*: they enter at the least recently used end (the next to go, tail first) on device
  and host, and are not written to disk when demoted. A cold block that a prefix hit finds becomes an
  ordinary one (a lease or a fork does not count), and so do a preempted request's blocks. ``M`` is
  chosen online by `TailCap`.

Why: on the Mooncake conversation trace three blocks in four are never looked up again, and which
will be cannot be told from the block (the study in ``benchmarks/cache_policies.py``). What can be
told is that the first blocks past a request's cached prefix are reused more often than its far tail
(0.40 against 0.23 of the time): another turn may branch from them. Capping how much of each new tail
gets a full LRU lifetime lets a small cache keep many conversations' heads instead of a few whole
conversations. How many blocks (``M``) pays depends on the capacity and the traffic, so `TailCap` runs
one key-only LRU per candidate ``M`` (no data, ``capacity`` keys each) on the same lookups and follows
the candidate that recently hit most (``M`` = unlimited is plain LRU, and is kept unless another
candidate does clearly better). The chained lookup rule (a request hits the leading run of its
blocks) is what the shadows simulate; they see prompts' lookup keys only (not output blocks) and treat
the tiers as one LRU of their summed capacity (a cold block first in that order is what the tiers drop
first).

Pinned blocks (in use by a running request, a lease, a host reservation) are never in any eviction
order, whatever the policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

POLICY_NAMES = ("lru", "cold-tail")
DEFAULT_POLICY = "cold-tail"
# Candidate caps on the hot part of a new tail (blocks past the cached prefix); None: no cap (LRU).
TAIL_CANDIDATES: tuple[int | None, ...] = (2, 4, 8, 16, 32, None)


def parse_policy(text: object) -> str:
    """``"lru"`` or ``"cold-tail"`` (any case, spaces around ignored).

    Raises:
        ValueError: any other value, naming the accepted ones.
    """
    norm = text.strip().lower() if isinstance(text, str) else None
    if norm not in POLICY_NAMES:
        raise ValueError(f"{text!r} is not a tier policy; use one of {', '.join(POLICY_NAMES)}")
    return norm


class ShadowLru:
    """Keys only, ordered exactly as a `BlockPool` of ``capacity`` blocks orders its cached blocks when
    requests run one at a time; the offline simulator of the store's device tier.

    `request` replays one request: its leading run of ``lookup`` keys found is pinned (taken out of the
    order), its blocks not found are allocated (free capacity first, then the least recently used keys
    are evicted), then everything is released back to front: keys up to ``M`` past the run at the most
    recently used end, the cold ones after them at the least recently used end, tail first. Set
    ``evicted`` to a list to have every evicted key appended to it, in order.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.order: OrderedDict[Hashable, None] = OrderedDict()  # first = next to evict
        self.evicted: list[Hashable] | None = None

    def __len__(self) -> int:
        return len(self.order)

    def match_prefix(self, lookup: Sequence[Hashable]) -> int:
        """Length of the leading run of ``lookup`` held; changes nothing."""
        n = 0
        for key in lookup:
            if key not in self.order:
                break
            n += 1
        return n

    def request(self, lookup: Sequence[Hashable], keys: Sequence[Hashable], tail_blocks: int | None = None,
                *, num_unkeyed: int = 0) -> int:
        """Replay one request; returns its hits (the leading run of ``lookup`` held).

        ``keys``: the request's full blocks (``lookup`` is a prefix of them); ``num_unkeyed``: blocks it
        also needs that get no key (its partial last block); ``tail_blocks``: ``M`` (None: no cap), so
        keys from ``hits + M`` on are cold. ``len(keys) + num_unkeyed`` must not exceed the capacity.
        """
        hit = self.match_prefix(lookup)
        for key in keys[:hit]:
            del self.order[key]  # pinned while the request runs
        free = self.capacity - len(self.order) - hit
        need = len(keys) - hit + num_unkeyed  # a key cached past the run is computed again, privately
        while need > free and self.order:
            victim, _ = self.order.popitem(last=False)
            if self.evicted is not None:
                self.evicted.append(victim)
            free += 1
        cold: list[Hashable] = []
        limit = len(keys) if tail_blocks is None else hit + tail_blocks
        for i in range(len(keys) - 1, -1, -1):  # released back to front
            key = keys[i]
            if i >= hit and key in self.order:
                continue  # another copy is cached: this request's block stays private and is freed
            if i >= limit:
                cold.append(key)
            else:
                self.order[key] = None
                self.order.move_to_end(key)
        for key in reversed(cold):  # head first, so the tail ends up next to evict
            self.order[key] = None
            self.order.move_to_end(key, last=False)
        return hit


class TailCap:
    """Chooses ``M``, the hot part of each new tail, by racing one `ShadowLru` per candidate.

    Call `observe` once per prompt with its lookup keys; it replays the prompt in every shadow (capacity
    ``capacity_blocks``, the store's blocks in all tiers) and returns the ``M`` to apply to that prompt
    (its blocks from ``hits + M`` on are cold; None: no cap). Every ``epoch`` prompts the
    shadows' hit counts (decayed by ``decay`` per epoch) are compared; the current ``M`` is replaced
    only by a candidate with more than ``hysteresis`` times its hits. Starts at no cap (LRU).

    Cost: ``len(candidates) × capacity_blocks`` keys of memory, and per prompt one dict operation per
    key per shadow.
    """

    def __init__(self, capacity_blocks: int, *, candidates: Sequence[int | None] = TAIL_CANDIDATES,
                 epoch: int = 100, decay: float = 0.97, hysteresis: float = 1.05) -> None:
        if not candidates or None not in candidates:
            raise ValueError("TailCap candidates must include None (no cap: plain LRU)")
        self.candidates = tuple(candidates)
        self.shadows = [ShadowLru(capacity_blocks) for _ in self.candidates]
        self.scores = [0.0] * len(self.candidates)
        self.epoch, self.decay, self.hysteresis = epoch, decay, hysteresis
        self.tail_blocks: int | None = None
        self.num_prompts = 0

    def observe(self, lookup: Sequence[Hashable]) -> int | None:
        """Replay the prompt in the shadows; the ``M`` now in force (None: no cap)."""
        for i, (m, shadow) in enumerate(zip(self.candidates, self.shadows, strict=True)):
            if len(lookup) <= shadow.capacity:
                self.scores[i] += shadow.request(lookup, lookup, m)
        self.num_prompts += 1
        if self.num_prompts % self.epoch == 0:
            self._choose()
        return self.tail_blocks

    def _choose(self) -> None:
        cur = self.candidates.index(self.tail_blocks)
        best = max(range(len(self.candidates)), key=lambda i: self.scores[i])
        if self.scores[best] > self.scores[cur] * self.hysteresis:
            self.tail_blocks = self.candidates[best]
        self.scores = [s * self.decay for s in self.scores]


class PolicySim:
    """The store's device order under tier policy ``policy``, offline: a `ShadowLru` of ``capacity``
    blocks and, for ``cold-tail``, the `TailCap` the store would run (``tail_options``: its keywords).

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY, **tail_options: float) -> None:
        self.cache = ShadowLru(capacity)
        self.tail = TailCap(capacity, **tail_options) if parse_policy(policy) == "cold-tail" else None  # type: ignore[arg-type]

    def request(self, lookup: Sequence[Hashable], keys: Sequence[Hashable], *, num_unkeyed: int = 0) -> int:
        """One request as the store runs it (`ShadowLru.request`); returns its hits."""
        m = self.tail.observe(lookup) if self.tail is not None else None
        return self.cache.request(lookup, keys, m, num_unkeyed=num_unkeyed)
