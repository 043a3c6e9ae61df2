"""``kvrelay bench cache-policies``: prefix-cache eviction policies replayed offline on a trace, against
the unbounded cache and the offline optimum (Belady) at the same capacity: the study that chose the
store's default tier policy (``cold-tail``, `kvstore.policy`; docs/concepts/tiers.md).

    kvrelay bench cache-policies                                  # capacities 2733 and 8000 blocks
    kvrelay bench cache-policies --capacities 1%,2%,5%,10%,20%,50%,100%   # of the unbounded footprint

The replay uses the engine's lookup rule on a Mooncake-format trace (``hash_ids``: one id per 512-token
block; the same id at the same position is the same prefix): a request looks up its first
``(input_length - 1) // 512`` blocks and hits the longest leading run that is cached; afterwards the
prompt's full blocks (``input_length // 512``) are in the cache. Capacity is in blocks.

Policies (all online, except Belady): ``lru``; ``leaf-lru`` (LRU among blocks with no cached child, as a
radix-tree cache evicts: a parent evicted before its children makes them unreachable); ``s3fifo``
(small probationary FIFO, main FIFO with a reuse bit, ghost keys; Yang et al., SOSP'23); ``arc``
(Megiddo & Modha, FAST'03); ``slru`` (new blocks enter a probationary LRU segment, hits move them to a
protected one of 80% of the capacity); ``store-lru`` and ``cold-tail`` (the store's own ordering and
tier policies, `kvstore.policy.PolicySim`, exactly as the store evicts with requests one at a time);
``belady`` (evicts the block next used farthest in the future); ``admit-oracle`` (offline too: leaf-LRU
that admits only blocks a later request will hit: perfect knowledge of whether a block comes back).
Every row also has each policy's ratio to ``lru``. The first ``--split`` of the trace decides, the rest
judges: ``first_*`` counts hits of the requests before the split, ``last_*`` of those after it (the cache
warmed by everything before).
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.common import emit
from kvrelay.benchmarks.offline_cache import belady_hits
from kvrelay.kvstore.policy import PolicySim

TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    lookup: tuple[int, ...]  # block keys looked up, leading run only
    insert: tuple[int, ...]  # block keys in the cache afterwards


def load_trace(path: Path = TRACE, limit: int | None = None) -> list[TraceRequest]:
    out = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            ids, n = tuple(row["hash_ids"]), int(row["input_length"])
            out.append(TraceRequest(ids[: (n - 1) // BLOCK_TOKENS], ids[: n // BLOCK_TOKENS]))
            if limit is not None and len(out) >= limit:
                break
    return out


class Policy:
    """An online cache of block keys. `lookup` returns the leading run found (and records the hits);
    `insert` adds the request's blocks (``parent`` of each: the block before it, or None)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def lookup(self, keys: Sequence[int]) -> int:
        raise NotImplementedError

    def insert(self, keys: Sequence[int]) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class Lru(Policy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.keys: OrderedDict[int, None] = OrderedDict()

    def lookup(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            self.keys.move_to_end(k)
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self.keys)


class LeafLru(Policy):
    """LRU over leaves only: a block with a cached child is never evicted before that child."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.clock = 0
        self.last: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        self.children: defaultdict[int, int] = defaultdict(int)
        self.heap: list[tuple[int, int]] = []  # (last use, key) of leaves; stale entries skipped

    def _touch(self, k: int) -> None:
        self.clock += 1
        self.last[k] = self.clock
        if self.children[k] == 0:
            heapq.heappush(self.heap, (self.clock, k))

    def lookup(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.last:
                break
            n += 1
        for k in reversed(keys[:n]):  # children first: the parent ends up the more recent
            self._touch(k)
        return n

    def insert(self, keys: Sequence[int]) -> None:
        prev: int | None = None
        for k in keys:
            if k not in self.last:
                self.parent[k] = prev
                if prev is not None:
                    self.children[prev] += 1
            prev = k
        for k in reversed(keys):
            self._touch(k)
        while len(self.last) > self.capacity:
            stamp, k = heapq.heappop(self.heap)
            if self.last.get(k) != stamp or self.children[k]:
                continue
            del self.last[k]
            p = self.parent.pop(k)
            if p is not None:
                self.children[p] -= 1
                if self.children[p] == 0 and p in self.last:
                    heapq.heappush(self.heap, (self.last[p], p))

    def __len__(self) -> int:
        return len(self.last)


class Slru(Policy):
    """Segmented LRU: new blocks are probationary; a hit makes a block protected (80% of capacity)."""

    def __init__(self, capacity: int, protected_frac: float = 0.8) -> None:
        super().__init__(capacity)
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        self.prot_cap = int(capacity * protected_frac)

    def lookup(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k in self.prot:
                self.prot.move_to_end(k)
            elif k in self.prob:
                del self.prob[k]
                self.prot[k] = None
                if len(self.prot) > self.prot_cap:
                    demoted, _ = self.prot.popitem(last=False)
                    self.prob[demoted] = None
            else:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        for k in keys:
            if k in self.prot:
                self.prot.move_to_end(k)
            else:
                self.prob[k] = None
                self.prob.move_to_end(k)
        while len(self.prob) + len(self.prot) > self.capacity:
            (self.prob or self.prot).popitem(last=False)

    def __len__(self) -> int:
        return len(self.prob) + len(self.prot)


class S3Fifo(Policy):
    """S3-FIFO: 10% small FIFO, main FIFO with a 0-3 use count, ghost keys of what left the small FIFO."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.small_cap = max(1, capacity // 10)

    def lookup(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.freq:
                break
            self.freq[k] = min(self.freq[k] + 1, 3)
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        for k in keys:
            if k in self.freq:
                continue
            while len(self.small) + len(self.main) >= self.capacity:
                self._evict()
            if k in self.ghost:
                del self.ghost[k]
                self.main[k] = None
            else:
                self.small[k] = None
            self.freq[k] = 0

    def _evict(self) -> None:
        if len(self.small) >= self.small_cap or not self.main:
            k, _ = self.small.popitem(last=False)
            if self.freq[k] > 0:
                self.main[k] = None
                self.freq[k] = 0
                return
            del self.freq[k]
            self.ghost[k] = None
            if len(self.ghost) > self.capacity:
                self.ghost.popitem(last=False)
            return
        while True:
            k, _ = self.main.popitem(last=False)
            if self.freq[k] > 0:
                self.freq[k] -= 1
                self.main[k] = None
                continue
            del self.freq[k]
            return

    def __len__(self) -> int:
        return len(self.small) + len(self.main)


class Arc(Policy):
    """ARC: recency (T1) and frequency (T2) lists with ghosts (B1, B2) steering the split ``p``."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0

    def lookup(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k in self.t1:
                del self.t1[k]
                self.t2[k] = None
            elif k in self.t2:
                self.t2.move_to_end(k)
            else:
                break
            n += 1
        return n

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            k, _ = self.t1.popitem(last=False)
            self.b1[k] = None
        elif self.t2:
            k, _ = self.t2.popitem(last=False)
            self.b2[k] = None
        else:
            k, _ = self.t1.popitem(last=False)
            self.b1[k] = None

    def insert(self, keys: Sequence[int]) -> None:
        c = self.capacity
        for k in keys:
            if k in self.t1 or k in self.t2:
                continue
            if k in self.b1:
                self.p = min(c, self.p + max(len(self.b2) // max(len(self.b1), 1), 1))
                self._replace(False)
                del self.b1[k]
                self.t2[k] = None
                continue
            if k in self.b2:
                self.p = max(0, self.p - max(len(self.b1) // max(len(self.b2), 1), 1))
                self._replace(True)
                del self.b2[k]
                self.t2[k] = None
                continue
            if len(self.t1) + len(self.b1) == c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                    self._replace(False)
                else:
                    self.t1.popitem(last=False)
            elif len(self.t1) + len(self.b1) < c:
                total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
                if total >= c:
                    if total == 2 * c and self.b2:
                        self.b2.popitem(last=False)
                    self._replace(False)
            self.t1[k] = None
        while len(self.t1) + len(self.t2) > c:
            self._replace(False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class StorePolicy(Policy):
    """The store's own ordering under tier policy ``policy`` (`kvstore.policy.PolicySim`: back-to-front
    release, evict before insert; with ``cold-tail`` the same `TailCap` the store runs picks ``M``)."""

    def __init__(self, capacity: int, policy: str = "cold-tail") -> None:
        super().__init__(capacity)
        self.sim = PolicySim(capacity, policy)
        self._lookup: Sequence[int] = ()

    def lookup(self, keys: Sequence[int]) -> int:
        self._lookup = keys
        return self.sim.cache.match_prefix(keys)

    def insert(self, keys: Sequence[int]) -> None:
        if len(keys) <= self.capacity:
            self.sim.request(self._lookup, keys)

    def __len__(self) -> int:
        return len(self.sim.cache)


POLICIES: dict[str, Callable[[int], Policy]] = {"lru": Lru, "leaf-lru": LeafLru, "slru": Slru, "s3fifo": S3Fifo,
                                                "arc": Arc, "store-lru": lambda c: StorePolicy(c, "lru"),
                                                "cold-tail": StorePolicy}


def replay(requests: Sequence[TraceRequest], policy: Policy, *, judge_from: int = 0) -> tuple[int, int]:
    """(blocks looked up, blocks hit) over ``requests[judge_from:]``; the ones before only warm the cache."""
    queried = hit = 0
    for i, req in enumerate(requests):
        n = policy.lookup(req.lookup)
        if i >= judge_from:
            queried += len(req.lookup)
            hit += n
        policy.insert(req.insert)
        assert len(policy) <= policy.capacity
    return queried, hit


class AdmitOracleLru(LeafLru):
    """Offline: leaf-LRU that caches a new block only if some later request will hit it (``reused``, from
    `reused_keys`). It knows *whether* a block comes back, not *when*."""

    def __init__(self, capacity: int, reused: set[int]) -> None:
        super().__init__(capacity)
        self.reused = reused

    def insert(self, keys: Sequence[int]) -> None:
        n = 0
        for k in keys:
            if k not in self.last and k not in self.reused:
                break
            n += 1
        super().insert(keys[:n])


def reused_keys(requests: Sequence[TraceRequest]) -> set[int]:
    """Keys some request hits in an unbounded cache (a block looked up after it was first cached)."""
    seen: set[int] = set()
    out: set[int] = set()
    for r in requests:
        for k in r.lookup:
            if k not in seen:
                break
            out.add(k)
        seen.update(r.insert)
    return out


def unbounded(requests: Sequence[TraceRequest], *, judge_from: int = 0) -> tuple[int, int]:
    return replay(requests, Lru(1 << 62), judge_from=judge_from)


def belady(requests: Sequence[TraceRequest], capacity: int, *, judge_from: int = 0) -> tuple[int, int]:
    """The offline optimum (`benchmarks.offline_cache.belady_hits`)."""
    h = belady_hits([(r.lookup, r.insert) for r in requests], capacity, judge_from=judge_from)
    return h.query_blocks, h.hit_blocks


def footprint(requests: Sequence[TraceRequest]) -> int:
    """Distinct blocks the requests cache: what an unbounded cache ends up holding."""
    return len({k for r in requests for k in r.insert})


def parse_capacities(text: str, requests: Sequence[TraceRequest]) -> list[int]:
    """``"2733,8000"`` in blocks, or ``"1%,50%"`` of the footprint (at least 1 block).

    Raises:
        ValueError: an entry that is neither.
    """
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(max(1, round(footprint(requests) * float(part[:-1]) / 100)) if part.endswith("%")
                       else int(part))
        except ValueError:
            raise ValueError(f"--capacities: {part!r} is neither blocks (e.g. 2733) nor a share (e.g. 5%)") from None
    return out


def run(requests_count: int, capacities: str, split: float) -> dict[str, Any]:
    reqs = load_trace(limit=requests_count)
    cut = int(len(reqs) * split)
    rows = []
    for cap in parse_capacities(capacities, reqs):
        row: dict[str, Any] = {"requests": len(reqs), "capacity_blocks": cap}
        for part, (lo, hi) in {"first": (0, cut), "last": (cut, len(reqs))}.items():
            window = reqs[:hi]
            q, h = unbounded(window, judge_from=lo)
            row[f"{part}_unbounded"] = round(h / q, 4)
            q, h = belady(window, cap, judge_from=lo)
            row[f"{part}_belady"] = round(h / q, 4)
            q, h = replay(window, AdmitOracleLru(cap, reused_keys(window)), judge_from=lo)
            row[f"{part}_admit-oracle"] = round(h / q, 4)
            for name, make in POLICIES.items():
                t0 = time.perf_counter()
                q, h = replay(window, make(cap), judge_from=lo)
                row[f"{part}_{name}"] = round(h / q, 4)
                row[f"{part}_{name}_s"] = round(time.perf_counter() - t0, 2)
            for name in (*POLICIES, "belady", "admit-oracle"):
                lru = row[f"{part}_lru"]
                row[f"{part}_{name}_vs_lru"] = round(row[f"{part}_{name}"] / lru, 3) if lru else None
        rows.append(row)
    return {"bench": "cache-policies", "trace": TRACE.name, "split": split, "footprint_blocks": footprint(reqs),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench cache-policies", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12031)
    p.add_argument("--capacities", default="2733,8000",
                   help="comma-separated, in blocks or as a share of the footprint (5%%)")
    p.add_argument("--split", type=float, default=0.6, help="share of the trace that decides (the rest judges)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    emit(run(a.requests, a.capacities, a.split), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
