"""Reference prefix-cache hit rates of a request sequence: unbounded, LRU, Belady, and the store's own
tier policy (`kvstore.policy`) simulated offline, in total or per tier.

All replay the prompts in send order with the engine's rules (docs/design.md §1–2):

* a block is ``block_size_tokens`` consecutive tokens; its key names the whole prefix up to it (chained);
* a request looks up the keys of its first ``(len(prompt) - 1) // B`` full blocks (at least one prompt
  token is always computed) and hits the longest **leading** run found — a missing block ends the run;
* afterwards every full block of what the server computed for it (the prompt, or prompt + reply when the
  workload knows the reply tokens) is in the cache, most recently used.

``belady_hit_blocks`` is the offline optimum at a capacity: it evicts the block next used farthest in the
future. ``policy_hit_blocks`` runs the store's own ordering and ``TailCap`` (`kvstore.policy.PolicySim`)
one request at a time: what a server with that policy and capacity gets with no concurrency.
``tier_hit_blocks`` splits LRU and Belady by tier: both are stack algorithms, so a tier below holding
``H`` blocks under ``D`` device blocks serves ``hits(D + H) - hits(D)``.

``lru_hit_blocks`` holds at most ``capacity_blocks`` keys and evicts the least recently used, which is
the cache a server of that total capacity could at best keep with LRU and no blocks pinned by running
requests. Worked example, B = 2, capacity 2 blocks::

    prompt            query keys     hits   cache after (LRU → MRU)
    [1,2,3,4,5]       k12 k1234      0      k12 k1234
    [1,2,3,4,9]       k12 k1234      2      k12 k1234
    [7,7,7]           k77            0      k1234 k77        (k12 evicted)
    [1,2,3,4,5]       k12 k1234      0      k12 k1234        (the run stops at the missing k12)
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvrelay.kvstore.policy import PolicySim

ROOT_KEY = b"kvrelay.bench.offline"


def chained_block_keys(token_ids: Sequence[int], block_size_tokens: int) -> list[bytes]:
    """Keys of every full block of ``token_ids``: ``key_i = sha256(key_{i-1} ‖ tokens_i as u32-LE)``."""
    keys: list[bytes] = []
    prev = ROOT_KEY
    for start in range(0, len(token_ids) - block_size_tokens + 1, block_size_tokens):
        chunk = token_ids[start : start + block_size_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(chunk)}I", *chunk)).digest()
        keys.append(prev)
    return keys


@dataclass(frozen=True, slots=True)
class CachedRequest:
    """One request of the replay: the prompt sent, and what ends up keyed on the server afterwards
    (``computed_token_ids``; defaults to the prompt)."""

    prompt_token_ids: tuple[int, ...]
    computed_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class HitCount:
    """Blocks looked up and blocks hit over a replay; ``hit_rate`` is 0 when nothing was looked up."""

    query_blocks: int
    hit_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


def _replay(requests: Iterable[CachedRequest], block_size_tokens: int, capacity_blocks: int | None) -> HitCount:
    cache: OrderedDict[bytes, None] = OrderedDict()
    queries = hits = 0
    for lookup, computed_keys in _key_pairs(requests, block_size_tokens):
        queries += len(lookup)
        for key in lookup:
            if key not in cache:
                break
            hits += 1
        for key in computed_keys:
            cache[key] = None
            cache.move_to_end(key)
            if capacity_blocks is not None and len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return HitCount(queries, hits)


def ideal_hit_blocks(requests: Iterable[CachedRequest], *, block_size_tokens: int) -> HitCount:
    """Hits with an unbounded cache: the workload's ideal (only the first sight of a block misses)."""
    return _replay(requests, block_size_tokens, None)


def lru_hit_blocks(requests: Iterable[CachedRequest], *, block_size_tokens: int, capacity_blocks: int) -> HitCount:
    """Hits of an LRU cache holding at most ``capacity_blocks`` blocks.

    Raises:
        ValueError: ``capacity_blocks`` < 0.
    """
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    return _replay(requests, block_size_tokens, capacity_blocks)


def _key_pairs(requests: Iterable[CachedRequest], block_size_tokens: int) -> list[tuple[list[bytes], list[bytes]]]:
    """(lookup keys, keys cached afterwards) of each request, by the rules of the module docstring."""
    out = []
    for req in requests:
        prompt = req.prompt_token_ids
        lookup = chained_block_keys(prompt, block_size_tokens)[: max(0, len(prompt) - 1) // block_size_tokens]
        computed = req.computed_token_ids if req.computed_token_ids is not None else prompt
        out.append((lookup, chained_block_keys(computed, block_size_tokens)))
    return out


def belady_hits(pairs: Sequence[tuple[Sequence[object], Sequence[object]]], capacity_blocks: int, *,
                judge_from: int = 0) -> HitCount:
    """Belady over ``(lookup, insert)`` key pairs: evict the key next referenced farthest away; among keys
    next used at the same time, the deepest in its chain first (a parent evicted before its child would
    leave the child unreachable). Requests before ``judge_from`` only warm the cache."""
    refs = [list(dict.fromkeys([*lookup, *insert])) for lookup, insert in pairs]  # chain order
    uses: defaultdict[object, list[int]] = defaultdict(list)  # key -> request indices, last first
    for i in range(len(pairs) - 1, -1, -1):
        for k in refs[i]:
            uses[k].append(i)
    never = len(pairs) + 1
    cached: dict[object, int] = {}  # key -> its next use
    heap: list[tuple[int, int, object]] = []  # (-next use, -push order, key); stale entries skipped
    queried = hits = tie = 0
    for i, (lookup, insert) in enumerate(pairs):
        n = 0
        for k in lookup:
            if k not in cached:
                break
            n += 1
        if i >= judge_from:
            queried += len(lookup)
            hits += n
        now_cached = set(insert) | set(lookup[:n])
        for k in refs[i]:
            stack = uses[k]
            while stack and stack[-1] <= i:
                stack.pop()
            if k in cached or k in now_cached:
                cached[k] = stack[-1] if stack else never
                tie += 1
                heapq.heappush(heap, (-cached[k], -tie, k))
        while len(cached) > capacity_blocks:
            neg, _, k = heapq.heappop(heap)
            if cached.get(k) == -neg:
                del cached[k]
    return HitCount(queried, hits)


def belady_hit_blocks(requests: Iterable[CachedRequest], *, block_size_tokens: int, capacity_blocks: int) -> HitCount:
    """Hits of the offline optimum holding at most ``capacity_blocks`` blocks."""
    return belady_hits(_key_pairs(requests, block_size_tokens), capacity_blocks)


def policy_hit_blocks(requests: Iterable[CachedRequest], *, block_size_tokens: int, capacity_blocks: int,
                      policy: str = "cold-tail") -> HitCount:
    """Hits of the store's ordering under tier policy ``policy`` (``lru`` | ``cold-tail``) with
    ``capacity_blocks`` blocks, requests one at a time, each also holding one unkeyed block (its partial
    last block) while it runs. A request larger than the capacity is skipped (a server rejects it).

    Raises:
        ValueError: an unknown policy.
    """
    sim = PolicySim(capacity_blocks, policy)
    queried = hits = 0
    for lookup, keys in _key_pairs(requests, block_size_tokens):
        queried += len(lookup)
        if len(keys) + 1 <= capacity_blocks:
            hits += sim.request(lookup, keys, num_unkeyed=1)
    return HitCount(queried, hits)


def tier_hit_blocks(requests: Iterable[CachedRequest], *, block_size_tokens: int,
                    tier_capacities: Sequence[tuple[str, int]]) -> dict[str, dict[str, HitCount]]:
    """``{"lru" | "belady": {tier: HitCount}}`` for tiers stacked in the order given (device first),
    each with its capacity in blocks, plus ``"total"``."""
    reqs = list(requests)
    out: dict[str, dict[str, HitCount]] = {"lru": {}, "belady": {}}
    for name, fn in (("lru", lru_hit_blocks), ("belady", belady_hit_blocks)):
        below = 0
        prev = HitCount(0, 0)
        for tier, cap in tier_capacities:
            below += cap
            cur = fn(reqs, block_size_tokens=block_size_tokens, capacity_blocks=below)
            out[name][tier] = HitCount(cur.query_blocks, cur.hit_blocks - prev.hit_blocks)
            prev = cur
        out[name]["total"] = prev
    return out
