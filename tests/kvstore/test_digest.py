"""Block digests (issue 16): what they bind, how they travel through the tiers, and what a mismatch does."""

from __future__ import annotations

import dataclasses
import random
import threading

import lmdb
import numpy as np
import pytest
import torch
import xxhash
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.kvstore.block_record import HEADER_BYTES
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.digest import (
    IntegrityPolicy,
    block_digest,
    digest_keyed,
    digest_slices,
    seed_of,
    slice_seed,
)
from kvrelay.kvstore.kv_events import KvEventLog
from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig

from tests.kvstore.store_helpers import SPEC, block_value, chain, write_blocks

KEYS = chain(6)


def sample(store, name: str, labels: dict[str, str] | None = None) -> float:
    return store.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def failures(store, where: str) -> float:
    return sample(store, "kvrelay_kv_integrity_failures_total", {"where": where})


def test_the_digest_is_xxh3_of_the_bytes_seeded_by_the_key():
    value = block_value(3)
    raw = value.numpy().tobytes()
    assert block_digest(KEYS[0], value) == xxhash.xxh3_64_intdigest(raw, seed=seed_of(KEYS[0]))
    assert block_digest(KEYS[0], raw) == block_digest(KEYS[0], np.frombuffer(raw, dtype=np.uint8))
    assert seed_of(KEYS[0]) == int.from_bytes(KEYS[0][:8], "little")
    # Bound to the key: the same bytes under another key (prefix, salt or model) differ.
    assert block_digest(KEYS[1], value) != block_digest(KEYS[0], value)
    other_model = dataclasses.replace(SPEC, model_fingerprint="other")
    assert block_digest(chain(1, spec=other_model)[0], value) != block_digest(KEYS[0], value)
    flipped = bytearray(raw)
    flipped[777] ^= 0x01
    assert block_digest(KEYS[0], bytes(flipped)) != block_digest(KEYS[0], raw)


def test_batched_digests_match_one_by_one_and_slices_differ_by_layer():
    pool = SPEC.new_pool(4)
    for b in range(4):
        pool[b].copy_(block_value(b))
    assert digest_keyed(pool, [2, 0], [KEYS[2], KEYS[0]]) == [block_digest(KEYS[2], pool[2]),
                                                                  block_digest(KEYS[0], pool[0])]
    got = digest_slices(pool, [1, 1, 3], [0, 1, 1])
    want = [xxhash.xxh3_64_intdigest(pool[b, lay].contiguous().view(torch.uint8).numpy().tobytes(),
                                     seed=slice_seed(lay)) for b, lay in ((1, 0), (1, 1), (3, 1))]
    assert got == want and len(set(got)) == 3


def test_integrity_policy_validates_and_picks():
    with pytest.raises(ValueError, match="'maybe' is not one of off, sampled, all"):
        IntegrityPolicy("maybe")
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\], got 0"):
        IntegrityPolicy("sampled", 0)
    assert IntegrityPolicy("all").pick(4) == [0, 1, 2, 3]
    assert IntegrityPolicy("off").pick(4) == [] and not IntegrityPolicy("off").enabled
    assert IntegrityPolicy("sampled", 1.0).pick(5) == [0, 1, 2, 3, 4]
    picked = IntegrityPolicy("sampled", 0.25).pick(4000, random.Random(7))
    assert 850 < len(picked) < 1150 and picked == sorted(set(picked))


def test_a_keyed_block_carries_its_digest_into_events_and_loses_it_with_its_key():
    pool = SPEC.new_pool(4)
    bp = BlockPool(4, digester=lambda ids, keys: digest_keyed(pool, ids, keys))
    events = KvEventLog()
    bp.add_listener(events)
    ids = bp.allocate(3)
    for b in ids:
        pool[b].copy_(block_value(b))
    assert bp.register_keys(ids, KEYS[:3], [False] * 3) == [True, True, True]
    assert [bp.digest_of(b) for b in ids] == [block_digest(k, pool[b]) for b, k in zip(ids, KEYS)]
    assert [e.digest for e in events.since(0).events] == [bp.digest_of(b) for b in ids]
    assert bp.register_key(ids[0], KEYS[4], digest=5) is False  # already keyed: nothing changes
    bp.release(ids)
    bp.evict_cached([ids[1]])
    assert bp.digest_of(ids[1]) is None and bp.digest_of(ids[0]) is not None
    new = bp.allocate(1)
    assert bp.register_key(new[0], KEYS[5], digest=42) and bp.digest_of(new[0]) == 42  # a given digest is kept
    bp.check_integrity()


def _demote_all(store, n: int) -> list[int]:
    """Write ``n`` blocks, release them, then push them out of device with ``n`` fresh allocations."""
    ids = write_blocks(store, KEYS[:n], [block_value(i) for i in range(n)])
    store.block_pool.release(ids)
    fill = store.block_pool.allocate(store.block_pool.num_blocks)
    store.block_pool.release(fill)
    return ids


def test_a_host_slot_overwritten_between_demotion_and_promotion_is_a_miss(make_store):
    store = make_store(num_device_blocks=4, num_host_blocks=8, watermark_blocks=0, integrity="all")
    _demote_all(store, 4)
    assert store.match_prefix(KEYS[:4]).tiers == ("host",) * 4
    slot = store.host.slot_of(KEYS[1])
    store.host.rows[slot][100] ^= 0x10
    ids = store.load(KEYS[:4], store.match_prefix(KEYS[:4]))
    assert len(ids) == 1 and torch.equal(store.device_pool[ids[0]], block_value(0))
    assert failures(store, "host") == 1
    assert sample(store, "kvrelay_kv_integrity_checks_total", {"where": "host"}) == 2
    assert not store.host.contains(KEYS[1])  # dropped where it came from
    assert store.block_pool.stats().num_in_use == 1  # the block it was copied into is free again
    store.block_pool.release(ids)


def test_with_integrity_off_the_overwritten_host_slot_is_served(make_store):
    store = make_store(num_device_blocks=4, num_host_blocks=8, watermark_blocks=0, integrity="off")
    _demote_all(store, 4)
    slot = store.host.slot_of(KEYS[1])
    store.host.rows[slot][100] ^= 0x10
    ids = store.load(KEYS[:4], store.match_prefix(KEYS[:4]))
    assert len(ids) == 4
    assert not torch.equal(store.device_pool[ids[1]], block_value(1))  # the corruption reached device
    assert failures(store, "host") == 0 and store.block_pool.digest_of(ids[1]) is None
    store.block_pool.release(ids)


def _rewrite(tmp_path, key: bytes, edit) -> None:
    env = lmdb.open(str(tmp_path / "kv"), max_dbs=3)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = bytearray(txn.get(key))
        edit(value)
        txn.put(key, value)
    env.close()


BIG = BlockSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size_tokens=4, model_fingerprint="test")


def _swap_two_words(value: bytearray) -> None:
    """Swap two different u64 words of the payload's first 4 KiB page: pagesum cannot see it, xxh3 can."""
    a, b = HEADER_BYTES + 8, HEADER_BYTES + 8 * 300
    assert value[a : a + 8] != value[b : b + 8]
    value[a : a + 8], value[b : b + 8] = value[b : b + 8], value[a : a + 8]


@pytest.mark.parametrize("integrity", ["all", "off"])
def test_an_altered_lmdb_value(tmp_path, integrity):
    """`all` (xxh3 records: the checksum is the digest) catches a change `off`'s pagesum cannot see."""
    keys = chain(3, spec=BIG)
    values = [block_value(i, spec=BIG) for i in range(3)]

    def open_store() -> TieredStore:
        config = TieredStoreConfig(num_device_blocks=8, disk_path=str(tmp_path / "kv"), disk_capacity_bytes=1 << 20,
                                   integrity=integrity)
        return TieredStore(BIG, config)

    store = open_store()
    ids = write_blocks(store, keys, values)
    digests = [store.block_pool.digest_of(b) for b in ids]
    store.persist()
    store.block_pool.release(ids)
    store.close()
    _rewrite(tmp_path, keys[1], _swap_two_words)
    store = open_store()
    ids = store.load(keys, store.match_prefix(keys))
    if integrity == "all":
        assert len(ids) == 1 and failures(store, "disk") == 1 and not store.disk.contains(keys[1])
        assert store.block_pool.digest_of(ids[0]) == digests[0]  # read back from the record, not recomputed
    else:
        assert len(ids) == 3 and failures(store, "disk") == 0
        assert not torch.equal(store.device_pool[ids[1]], values[1])  # the corruption reached device
    store.block_pool.release(ids)
    store.check_integrity()
    store.close()


def test_a_device_block_changed_after_keying_is_not_laundered_into_a_valid_disk_record(make_store):
    store = make_store(num_device_blocks=4, disk=True, integrity="sampled")  # disk records are always checked
    ids = write_blocks(store, KEYS[:2], [block_value(0), block_value(1)])
    store.device_pool[ids[1]].view(-1)[5] += 1.0  # after the digest was taken
    store.block_pool.release(ids)
    store.block_pool.release(store.block_pool.allocate(4))  # demote both to disk
    store.flush()
    got = store.load(KEYS[:2], store.match_prefix(KEYS[:2]))
    assert len(got) == 1 and failures(store, "disk") == 1
    store.block_pool.release(got)


def test_a_block_still_queued_for_disk_is_checked_too(make_store, monkeypatch):
    """The writer is held back, so the promotion reads the queued record from memory: checked all the same."""
    store = make_store(num_device_blocks=4, disk=True, integrity="all")
    gate = threading.Event()
    write = store.disk._writer._write
    monkeypatch.setattr(store.disk._writer, "_write", lambda *args: (gate.wait(10), write(*args))[1])
    ids = write_blocks(store, KEYS[:2], [block_value(0), block_value(1)])
    store.device_pool[ids[1]].view(-1)[5] += 1.0  # after the digest was taken
    store.block_pool.release(ids)
    store.block_pool.release(store.block_pool.allocate(4))  # demote both to disk: queued, not committed
    assert store.disk.index.get(KEYS[1]).record is not None
    got = store.load(KEYS[:2], store.match_prefix(KEYS[:2]))
    assert len(got) == 1 and failures(store, "disk") == 1 and not store.disk.contains(KEYS[1])
    gate.set()
    store.block_pool.release(got)
