"""Reference prefix-cache hit rates of a request sequence: ideal (unbounded cache) and offline LRU.

Both replay the prompts in send order with the engine's rules (DESIGN §1–2):

* a block is ``block_size_tokens`` consecutive tokens; its key names the whole prefix up to it (chained);
* a request looks up the keys of its first ``(len(prompt) - 1) // B`` full blocks (at least one prompt
  token is always computed) and hits the longest **leading** run found — a missing block ends the run;
* afterwards every full block of what the server computed for it (the prompt, or prompt + reply when the
  workload knows the reply tokens) is in the cache, most recently used.

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
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
    for req in requests:
        prompt = req.prompt_token_ids
        keys = chained_block_keys(prompt, block_size_tokens)
        lookup = keys[: max(0, len(prompt) - 1) // block_size_tokens]
        queries += len(lookup)
        for key in lookup:
            if key not in cache:
                break
            hits += 1
        computed = req.computed_token_ids if req.computed_token_ids is not None else prompt
        for key in chained_block_keys(computed, block_size_tokens):
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
