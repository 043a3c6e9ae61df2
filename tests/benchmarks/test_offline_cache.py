"""`benchmarks.offline_cache` on hand-computed sequences."""

from __future__ import annotations

import pytest
from kvrelay.benchmarks.offline_cache import (
    CachedRequest,
    HitCount,
    chained_block_keys,
    ideal_hit_blocks,
    lru_hit_blocks,
)


def reqs(*prompts: tuple[int, ...]) -> list[CachedRequest]:
    return [CachedRequest(p) for p in prompts]


def test_keys_are_chained_over_full_blocks_only():
    a = chained_block_keys([1, 2, 3, 4, 5], 2)
    b = chained_block_keys([1, 2, 3, 9], 2)
    c = chained_block_keys([3, 4], 2)
    assert len(a) == 2 and len(b) == 2
    assert a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[1]  # same tokens, different prefix
    assert chained_block_keys([1, 2, 3, 4, 5], 2) == a  # deterministic


def test_docstring_example_block_2_capacity_2():
    seq = reqs((1, 2, 3, 4, 5), (1, 2, 3, 4, 9), (7, 7, 7), (1, 2, 3, 4, 5))
    # queries: 2 + 2 + 1 + 2; LRU hits: 0, 2, 0, 0 (k12 was evicted by k77)
    assert lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=2) == HitCount(7, 2)
    # ideal: 0, 2, 0, 2
    assert ideal_hit_blocks(seq, block_size_tokens=2) == HitCount(7, 4)


def test_last_token_is_always_computed():
    # 4 tokens, block 2: only (4 - 1) // 2 = 1 block is looked up, even when both are cached
    seq = reqs((1, 2, 3, 4), (1, 2, 3, 4))
    assert ideal_hit_blocks(seq, block_size_tokens=2) == HitCount(2, 1)


def test_a_missing_block_ends_the_run():
    # capacity 3, block 2:
    # r1 (1,2,3,4,5,6,7): keys k12 k1234 k123456 -> cache [k12, k1234, k123456]
    # r2 (5,5,0): key k55 -> evicts k12 -> [k1234, k123456, k55]
    # r3 (1,2,3,4,5,6,7): k12 missing -> 0 hits, although k1234 and k123456 are still cached
    seq = reqs((1, 2, 3, 4, 5, 6, 7), (5, 5, 0), (1, 2, 3, 4, 5, 6, 7))
    assert lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=3) == HitCount(3 + 1 + 3, 0)
    assert lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=4) == HitCount(7, 3)


def test_hits_refresh_recency():
    # capacity 2, block 2: A=(1,2,9) B=(3,4,9) A again (hit refreshes k12), C=(5,6,9) evicts k34 not k12
    seq = reqs((1, 2, 9), (3, 4, 9), (1, 2, 9), (5, 6, 9), (1, 2, 9), (3, 4, 9))
    assert lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=2) == HitCount(6, 2)


def test_computed_tokens_extend_the_cache():
    # the reply (7, 8) of the first request becomes part of the second prompt
    seq = [CachedRequest((1, 2), (1, 2, 7, 8)), CachedRequest((1, 2, 7, 8, 3))]
    assert ideal_hit_blocks(seq, block_size_tokens=2) == HitCount(0 + 2, 2)
    assert ideal_hit_blocks([CachedRequest((1, 2)), CachedRequest((1, 2, 7, 8, 3))],
                            block_size_tokens=2) == HitCount(2, 1)


def test_capacity_zero_never_hits_and_negative_raises():
    seq = reqs((1, 2, 3), (1, 2, 3))
    assert lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=0).hit_blocks == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=-1)
    assert HitCount(0, 0).hit_rate == 0.0


def test_belady_keeps_what_is_used_next():
    from kvrelay.benchmarks.offline_cache import belady_hit_blocks

    seq = reqs((1, 2, 3, 4, 5), (1, 2, 3, 4, 9), (7, 7, 7), (1, 2, 3, 4, 5))
    # At the third request k77 (never used again) is evicted, not k12 / k1234: all 4 later hits kept.
    assert belady_hit_blocks(seq, block_size_tokens=2, capacity_blocks=2) == HitCount(7, 4)
    assert belady_hit_blocks(seq, block_size_tokens=2, capacity_blocks=0) == HitCount(7, 0)


def test_store_policy_replay_counts_the_partial_block_and_evicts_before_inserting():
    from kvrelay.benchmarks.offline_cache import policy_hit_blocks

    seq = reqs((1, 2, 3, 4, 5), (1, 2, 3, 4, 9), (7, 7, 7), (1, 2, 3, 4, 5))
    # Capacity 3 = 2 keyed blocks + the running request's partial one. The third request needs 2 blocks
    # with 1 free: it evicts k1234 (released before k12, so less recent); the fourth hits k12 only.
    assert policy_hit_blocks(seq, block_size_tokens=2, capacity_blocks=3, policy="lru") == HitCount(7, 3)
    with pytest.raises(ValueError, match="not a tier policy"):
        policy_hit_blocks(seq, block_size_tokens=2, capacity_blocks=3, policy="fifo")


def test_tier_split_adds_up_to_the_total():
    from kvrelay.benchmarks.offline_cache import tier_hit_blocks

    seq = reqs((1, 2, 3, 4, 5), (1, 2, 3, 4, 9), (7, 7, 7), (1, 2, 3, 4, 5), (7, 7, 7, 7, 1))
    split = tier_hit_blocks(seq, block_size_tokens=2, tier_capacities=[("device", 1), ("host", 1), ("disk", 2)])
    for name in ("lru", "belady"):
        parts = split[name]
        assert sum(parts[t].hit_blocks for t in ("device", "host", "disk")) == parts["total"].hit_blocks
    assert split["lru"]["total"] == lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=4)
    assert split["lru"]["device"] == lru_hit_blocks(seq, block_size_tokens=2, capacity_blocks=1)
    assert split["belady"]["total"].hit_blocks >= split["lru"]["total"].hit_blocks
