import errno

import kvrelay.kvstore.lmdb_tier as lmdb_tier_module
import lmdb
import pytest
import torch
from kvrelay.kvstore.tiered_store import TierMove

from tests.kvstore.store_helpers import SPEC, block_value, chain, write_blocks

KEYS = chain(8)
NAME = {k: f"A{i}" for i, k in enumerate(KEYS)}


def moves_named(moves: list[TierMove]) -> list[tuple[str, str, str]]:
    return [(NAME[m.key], m.src, m.dst) for m in moves]


def sample(store, name: str, labels: dict[str, str] | None = None) -> float:
    return store.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_scripted_demotion_and_promotion_order(make_store):
    moves: list[TierMove] = []
    store = make_store(num_device_blocks=4, num_host_blocks=2, disk=True, watermark_blocks=0, on_move=moves.append)
    a = write_blocks(store, KEYS[:4], [block_value(i) for i in range(4)])
    assert a == [0, 1, 2, 3]
    store.block_pool.release(a)  # cached LRU: A3, A2, A1, A0 (a finished chain goes tail first)
    b = store.block_pool.allocate(4)  # evicts all four; host holds two, its evictions go to disk
    assert moves_named(moves) == [
        ("A3", "device", "host"), ("A2", "device", "host"),
        ("A3", "host", "disk"), ("A1", "device", "host"),
        ("A2", "host", "disk"), ("A0", "device", "host"),
    ]
    assert store.host.keys_lru_first() == [KEYS[1], KEYS[0]]
    store.flush()
    assert store.disk.keys_lru_first() == [KEYS[3], KEYS[2]]
    store.block_pool.release(b)  # unkeyed: plain free blocks
    match = store.match_prefix(KEYS[:5])
    assert (match.num_blocks, match.tiers, match.device_block_ids) == (4, ("host", "host", "disk", "disk"), ())
    del moves[:]
    ids = store.load(KEYS[:5], match)
    assert ids == [0, 1, 2, 3]  # b was [3, 2, 1, 0]; release walks it back to front
    assert moves_named(moves) == [
        ("A0", "host", "device"), ("A1", "host", "device"), ("A2", "disk", "device"), ("A3", "disk", "device"),
    ]
    for i, block_id in enumerate(ids):
        assert torch.equal(store.device_pool[block_id], block_value(i))
        assert store.block_pool.ref_count(block_id) == 1 and store.block_pool.key_of(block_id) == KEYS[i]
    assert store.host.keys_lru_first() == []  # host is a victim cache: promoted blocks leave it
    assert store.disk.match_prefix([KEYS[2], KEYS[3]]) == 2  # disk keeps them
    assert sample(store, "kvrelay_prefix_cache_queries_total") == 5
    assert sample(store, "kvrelay_prefix_cache_hits_total", {"tier": "host"}) == 2
    assert sample(store, "kvrelay_prefix_cache_hits_total", {"tier": "disk"}) == 2
    assert sample(store, "kvrelay_tier_moves_total", {"src": "device", "dst": "host"}) == 4
    store.block_pool.release(ids)
    del moves[:]
    store.block_pool.release(store.block_pool.allocate(4))  # demote again: A2, A3 are already on disk
    assert moves_named(moves) == [
        ("A3", "device", "host"), ("A2", "device", "host"), ("A1", "device", "host"), ("A0", "device", "host"),
    ]
    assert store.stats().tier_to_hits == {"device": 0, "host": 2, "disk": 2}


def test_watermark_precopies_coldest_blocks_so_eviction_copies_nothing(make_store):
    moves: list[TierMove] = []
    store = make_store(num_device_blocks=4, num_host_blocks=4, watermark_blocks=2, on_move=moves.append)
    store.block_pool.release(write_blocks(store, KEYS[:4], [block_value(i) for i in range(4)]))
    assert store.maintain_watermark() == 2
    assert moves_named(moves) == [("A3", "device", "host"), ("A2", "device", "host")]
    assert store.maintain_watermark() == 0  # nothing to do: already on host
    new = store.block_pool.allocate(2)  # evicts A3 and A2: found on host, nothing copied
    assert len(moves) == 2
    assert store.match_prefix(KEYS[:4]).tiers == ("device", "device", "host", "host")
    more = store.block_pool.allocate(1)  # A1 was not pre-copied: copied now
    assert moves_named(moves[2:]) == [("A1", "device", "host")]
    store.block_pool.release(new + more)
    assert store.maintain_watermark() == 0  # three blocks are free again
    assert torch.equal(store.host.pool[store.host.slot_of(KEYS[2])], block_value(2))


def test_prefix_split_across_device_host_and_disk_loads_original_bytes(make_store):
    store = make_store(num_device_blocks=8, num_host_blocks=4, disk=True)
    values = [block_value(i) for i in range(7)]
    store.block_pool.release(write_blocks(store, KEYS[:2], values[:2]))
    for i in (2, 3):
        store.host.put(KEYS[i], values[i])
    for i in (4, 5):
        store.disk.put(KEYS[i], values[i])
    store.flush()
    match = store.match_prefix(KEYS)
    assert match.tiers == ("device", "device", "host", "host", "disk", "disk")
    assert match.device_block_ids == (0, 1) and match.num_hits("disk") == 2
    ids = store.load(KEYS, match)
    assert len(ids) == 6 and ids[:2] == [0, 1]
    for i, block_id in enumerate(ids):
        assert torch.equal(store.device_pool[block_id], values[i]), f"block {i}"
        assert store.block_pool.ref_count(block_id) == 1
    for tier, n in (("device", 2), ("host", 2), ("disk", 2)):
        assert sample(store, "kvrelay_prefix_cache_hits_total", {"tier": tier}) == n
    store.block_pool.release(ids)
    assert store.match_prefix(KEYS).tiers == ("device",) * 6


def test_a_corrupt_disk_block_shortens_the_run_and_the_rest_is_recomputed(make_store, tmp_path):
    store = make_store(num_device_blocks=8, disk=True)
    for i in range(4):
        store.disk.put(KEYS[i], block_value(i))
    store.close()
    env = lmdb.open(str(tmp_path / "kv"), max_dbs=3)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = bytearray(txn.get(KEYS[2]))
        value[-SPEC.block_bytes] ^= 0xFF
        txn.put(KEYS[2], value)
    env.close()
    store = make_store(num_device_blocks=8, disk=True)
    match = store.match_prefix(KEYS[:4])
    assert match.tiers == ("disk",) * 4
    ids = store.load(KEYS[:4], match)
    assert len(ids) == 2 and [store.block_pool.ref_count(b) for b in ids] == [1, 1]
    assert store.block_pool.stats().num_in_use == 2  # nothing beyond the run is held
    assert sample(store, "kvrelay_store_corrupt_total") == 1
    # The caller recomputes blocks 2 and 3 (here: writes the right values) and registers them.
    ids += write_blocks(store, KEYS[2:4], [block_value(2), block_value(3)])
    for i, block_id in enumerate(ids):
        assert torch.equal(store.device_pool[block_id], block_value(i))
    store.block_pool.release(ids)
    assert store.match_prefix(KEYS[:4]).tiers == ("device",) * 4


def test_an_io_error_shortens_the_run_and_keeps_the_disk_entry(make_store, monkeypatch):
    store = make_store(num_device_blocks=4, disk=True)
    for i in range(2):
        store.disk.put(KEYS[i], block_value(i))
    store.flush()

    def failing_copy(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(lmdb_tier_module, "read_value", failing_copy)
    match = store.match_prefix(KEYS[:2])
    assert store.load(KEYS[:2], match) == []
    assert store.block_pool.stats().num_in_use == 0
    monkeypatch.undo()
    ids = store.load(KEYS[:2], store.match_prefix(KEYS[:2]))
    assert [torch.equal(store.device_pool[b], block_value(i)) for i, b in enumerate(ids)] == [True, True]
    store.block_pool.release(ids)


def test_load_stops_where_no_device_block_is_free(make_store):
    store = make_store(num_device_blocks=3, num_host_blocks=4)
    for i in range(3):
        store.host.put(KEYS[i], block_value(i))
    busy = store.block_pool.allocate(2)
    ids = store.load(KEYS[:3], store.match_prefix(KEYS[:3]))
    assert len(ids) == 1 and torch.equal(store.device_pool[ids[0]], block_value(0))
    store.block_pool.release(busy + ids)


def test_seen_twice_admission_writes_only_blocks_two_prompts_contained(make_store):
    store = make_store(num_device_blocks=2, disk=True, admit="seen>=2")
    once, twice = KEYS[0], chain(1, first_token=100)[0]
    store.match_prefix([once])
    store.match_prefix([twice])
    store.match_prefix([twice])
    store.block_pool.release(write_blocks(store, [once, twice], [block_value(0), block_value(1)]))
    store.block_pool.release(store.block_pool.allocate(2))
    store.flush()
    assert store.disk.keys_lru_first() == [twice]
    assert sample(store, "kvrelay_tier_evictions_total", {"tier": "device"}) == 1


def test_device_only_store_drops_evicted_blocks(make_store):
    store = make_store(num_device_blocks=2)
    assert store.host is None and store.disk is None and store.maintain_watermark() == 0
    store.block_pool.release(write_blocks(store, KEYS[:2], [block_value(0), block_value(1)]))
    store.block_pool.release(store.block_pool.allocate(1))
    assert store.match_prefix(KEYS[:2]).tiers == ("device",)
    assert sample(store, "kvrelay_tier_evictions_total", {"tier": "device"}) == 1
    assert store.stats().host is None and store.persist() == 0


def test_record_prompt_counts_prefixes_shorter_than_one_block(make_store):
    store = make_store(num_device_blocks=2)
    b = SPEC.block_size_tokens
    store.record_prompt(b, 0)  # the last token is always computed: nothing shareable
    store.record_prompt(3 * b, 2)  # shares 2 tokens with an earlier prompt: below a block
    store.record_prompt(3 * b, 0)  # had full blocks, none cached: an ordinary miss
    store.record_prompt(3 * b, b)  # a hit
    assert sample(store, "kvrelay_prompts_total") == 4
    assert sample(store, "kvrelay_prefix_shorter_than_block_total") == 2


def test_persist_writes_device_and_host_blocks_for_a_restart(make_store):
    store = make_store(num_device_blocks=4, num_host_blocks=2, disk=True)
    held = write_blocks(store, KEYS[:2], [block_value(0), block_value(1)])
    store.host.put(KEYS[2], block_value(2))
    assert store.persist() == 3
    assert store.disk.match_prefix(KEYS[:3]) == 3
    store.block_pool.release(held)


def test_bad_config_is_refused():
    from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig

    with pytest.raises(ValueError, match="not an admission policy"):
        TieredStore(SPEC, TieredStoreConfig(num_device_blocks=2, admit="twice"))
    with pytest.raises(ValueError, match="device pool shape"):
        TieredStore(SPEC, TieredStoreConfig(num_device_blocks=2), device_pool=SPEC.new_pool(3))
