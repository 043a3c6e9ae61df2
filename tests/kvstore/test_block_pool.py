import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_pool import BlockPool, NoFreeBlocksError


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


def test_allocate_takes_free_blocks_in_order_then_raises():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.try_allocate(2) is None
    with pytest.raises(NoFreeBlocksError, match="need 2 KV blocks but only 1"):
        pool.allocate(2)
    assert pool.allocate(1) == [3]
    pool.check_integrity()


def test_finished_chain_is_evicted_tail_first_and_free_blocks_go_before_cached():
    evicted: list[tuple[int, BlockKey]] = []
    pool = BlockPool(6, on_evict=lambda b, k: evicted.append((b, k)))
    chain = pool.allocate(3)  # [0, 1, 2]
    for i, b in enumerate(chain):
        assert pool.register_key(b, key(i))
    pool.release(chain)
    assert pool.stats().num_cached == 3 and pool.stats().num_free == 3
    # Three plain free blocks are used before any cached block is evicted.
    assert pool.allocate(3) == [3, 4, 5]
    assert evicted == []
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [1]
    assert evicted == [(2, key(2)), (1, key(1))]
    assert pool.match_prefix([key(0), key(1)]) == [0]
    pool.check_integrity()


def test_lru_order_across_chains_and_prefix_hit_refreshes():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    for i, blk in enumerate(a + b):
        pool.register_key(blk, key(i))
    pool.release(a)  # cached order: 1, 0
    pool.release(b)  # cached order: 1, 0, 3, 2
    hit = pool.match_prefix([key(0)])
    assert hit == [0]
    pool.acquire(hit)
    pool.release(hit)  # 0 is now most recently used: 1, 3, 2, 0
    assert pool.coldest_cached(4) == [1, 3, 2, 0]
    assert pool.allocate(4) == [1, 3, 2, 0]
    pool.check_integrity()


def test_ref_counts_shared_block_stays_in_use_until_last_release():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.register_key(b, key(7))
    pool.acquire([b])
    assert pool.ref_count(b) == 2
    pool.release([b])
    assert pool.ref_count(b) == 1 and pool.stats().num_in_use == 1
    pool.release([b])
    assert pool.stats().num_cached == 1
    with pytest.raises(ValueError, match="released more often"):
        pool.release([b])
    pool.check_integrity()


def test_duplicate_key_keeps_first_block_and_match_stops_at_gap():
    pool = BlockPool(4)
    x, y = pool.allocate(2)
    assert pool.register_key(x, key(1))
    assert not pool.register_key(y, key(1))
    assert pool.key_of(y) is None
    assert pool.match_prefix([key(1), key(2), key(3)]) == [x]
    assert pool.match_prefix([key(2), key(1)]) == []
    pool.release([y])
    assert pool.stats().num_free == 3  # y was unkeyed: straight back to free
    pool.check_integrity()


def test_acquire_free_block_and_key_unused_block_are_refused():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 0 is free"):
        pool.acquire([0])
    with pytest.raises(ValueError, match="not in use"):
        pool.register_key(1, key(1))


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "release", "share", "key", "hit"]), st.integers(0, 7)), max_size=80
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_sequences_keep_integrity(program):
    pool = BlockPool(8)
    held: list[int] = []  # one entry per reference this test holds
    next_key = 0
    for op, n in program:
        if op == "alloc":
            got = pool.try_allocate(n % 4 + 1)
            if got is not None:
                held.extend(got)
        elif op == "release" and held:
            pool.release([held.pop(n % len(held))])
        elif op == "share" and held:
            b = held[n % len(held)]
            pool.acquire([b])
            held.append(b)
        elif op == "key" and held:
            pool.register_key(held[n % len(held)], key(next_key))
            next_key += 1
        elif op == "hit" and next_key:
            hit = pool.match_prefix([key(n % next_key)])
            pool.acquire(hit)
            held.extend(hit)
        pool.check_integrity()
        for b in set(held):
            assert pool.ref_count(b) == held.count(b)
    pool.release(held)
    pool.check_integrity()
    assert pool.stats().num_in_use == 0
