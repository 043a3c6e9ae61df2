"""`benchmarks.cache_policies` (issue 18's study): every policy within capacity, exact eviction order on
scripted sequences, Belady never beaten, and the trace numbers the issue quotes reproduced."""

from __future__ import annotations

import random

import pytest
from kvrelay.benchmarks.cache_policies import (
    POLICIES,
    Arc,
    LeafLru,
    Lru,
    S3Fifo,
    Slru,
    TraceRequest,
    belady,
    load_trace,
    replay,
    unbounded,
)


def requests_of(chains: list[list[int]]) -> list[TraceRequest]:
    return [TraceRequest(tuple(c[:-1]), tuple(c)) for c in chains]


def test_lru_and_leaf_lru_evict_in_the_expected_order():
    lru = Lru(3)
    lru.insert([1, 2])
    lru.insert([7])
    assert lru.lookup([1, 2, 3]) == 2  # 1 and 2 are now the most recent
    lru.insert([9])
    assert list(lru.keys) == [1, 2, 9]  # 7 was least recent
    leaf = LeafLru(3)
    leaf.insert([1, 2, 3])  # a chain: 1 is 2's parent, 2 is 3's
    leaf.insert([8])
    assert sorted(leaf.last) == [1, 2, 8]  # the leaf 3 went, never its ancestors
    assert leaf.lookup([1, 2, 3]) == 2


def test_slru_protects_what_was_hit_and_s3fifo_keeps_reused_blocks():
    slru = Slru(4, protected_frac=0.5)
    slru.insert([1, 2, 3, 4])
    assert slru.lookup([1]) == 1  # 1 is protected now
    slru.insert([5, 6])
    assert list(slru.prot) == [1] and list(slru.prob) == [4, 5, 6]  # probationary 2 and 3 went first
    s3 = S3Fifo(10)
    s3.insert([1])
    assert s3.lookup([1]) == 1
    s3.insert(list(range(100, 120)))  # a flood of one-off blocks
    assert s3.lookup([1]) == 1  # the block that was reused survived it


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_capacity_holds_and_belady_is_never_beaten(name):
    rng = random.Random(name)
    chains = []
    for _ in range(400):
        root = rng.choice([0, 0, 1])
        chains.append([root] + [rng.randrange(2, 60) * 1000 + d for d in range(rng.randrange(1, 6))])
    reqs = requests_of(chains)
    for cap in (3, 10, 40):
        q, h = replay(reqs, POLICIES[name](cap))  # asserts the capacity after every request
        qb, hb = belady(reqs, cap)
        qu, hu = unbounded(reqs)
        assert q == qb == qu and h <= hb <= hu


def test_the_trace_numbers_the_issue_quotes():
    reqs = load_trace(limit=3000)
    q, h = unbounded(reqs)
    assert round(h / q, 3) == 0.326
    q, h = replay(reqs, Lru(2733))
    assert round(h / q, 3) == 0.061
    q, h = belady(reqs, 2733)
    assert round(h / q, 3) == 0.281  # the issue: 0.285 (its per-block Belady breaks ties otherwise)
    q, h = replay(reqs, Arc(2733))
    assert round(h / q, 3) == 0.08


def test_capacities_in_blocks_or_as_a_share_of_the_footprint():
    from kvrelay.benchmarks.cache_policies import footprint, parse_capacities

    reqs = requests_of([[0, 1, 2], [0, 1, 3], [5]])
    assert footprint(reqs) == 5  # 0, 1, 2, 3, 5
    assert parse_capacities("40%, 7, 1%", reqs) == [2, 7, 1]
    with pytest.raises(ValueError, match="'big' is neither blocks"):
        parse_capacities("big", reqs)


def test_admission_oracle_admits_only_blocks_that_come_back():
    from kvrelay.benchmarks.cache_policies import AdmitOracleLru, reused_keys

    reqs = requests_of([[0, 1, 2], [0, 1, 3], [0, 7], [0, 1, 9]])
    assert reused_keys(reqs) == {0, 1}
    cache = AdmitOracleLru(10, reused_keys(reqs))
    assert replay(reqs, cache) == (7, 5)  # lookups [0,1] [0,1] [0] [0,1]; hits 0 + 2 + 1 + 2
    assert sorted(cache.last) == [0, 1]  # 2, 3, 7 and 9 never came back and were never cached
