import errno
import os
import stat

import kvrelay.kvstore.lmdb_tier as lmdb_tier_module
import lmdb
import pytest
import torch
from kvrelay.kvstore.block_record import HEADER_BYTES, record_bytes
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.digest import block_digest
from kvrelay.kvstore.lmdb_env import DiskTierInUseError
from kvrelay.kvstore.lmdb_tier import LmdbOptions

from tests.kvstore.store_helpers import SPEC, block_value, chain

PAGE = 4096  # SPEC blocks (2 KiB) take one page each


def read(tier, key) -> torch.Tensor | None:
    dst = torch.empty(SPEC.block_shape)
    return dst if tier.get_into(key, dst) else None


def rewrite_value(path, key, edit) -> None:
    """Open the closed environment directly and replace ``key``'s value with ``edit(old)``."""
    env = lmdb.open(str(path), max_dbs=3)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        txn.put(key, edit(bytes(txn.get(key))))
    env.close()


def corrupt_count(tier) -> float:
    return tier.metrics.registry.get_sample_value("kvrelay_store_corrupt_total")


def test_roundtrip_queued_then_committed_then_after_reopen_with_lru_order(make_disk, tmp_path):
    keys = chain(6)
    tier = make_disk()
    for i, key in enumerate(keys):
        assert tier.put(key, block_value(i))
    assert torch.equal(read(tier, keys[2]), block_value(2))  # may still be queued: served from memory
    tier.flush()
    assert torch.equal(read(tier, keys[0]), block_value(0))  # committed: read through LMDB
    tier.add_counters({"hits.disk": 2})
    assert tier.keys_lru_first() == [keys[1], keys[3], keys[4], keys[5], keys[2], keys[0]]
    tier.check_integrity()
    tier.close()
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    again = make_disk()
    assert again.keys_lru_first() == [keys[1], keys[3], keys[4], keys[5], keys[2], keys[0]]
    assert again.match_prefix(keys) == 6
    assert all(torch.equal(read(again, k), block_value(i)) for i, k in enumerate(keys))
    assert again.read_counters()["hits.disk"] == 2


def test_high_watermark_evicts_lru_down_to_low_watermark(make_disk):
    options = LmdbOptions(high_watermark_frac=0.5, low_watermark_frac=0.25)
    tier = make_disk(capacity_bytes=106 * PAGE, options=options)  # 42 usable pages: high 20 blocks, low 10
    assert tier.capacity_blocks == 20
    keys = chain(21)
    for i in range(20):
        tier.put(keys[i], block_value(i))
    assert read(tier, keys[0]) is not None  # k0 becomes most recently used
    tier.put(keys[20], block_value(20))
    assert tier.keys_lru_first() == keys[12:20] + [keys[0], keys[20]]
    assert tier.disk_stats().num_evicted == 11
    assert tier.metrics.registry.get_sample_value("kvrelay_tier_evictions_total", {"tier": "disk"}) == 11
    assert read(tier, keys[5]) is None and torch.equal(read(tier, keys[20]), block_value(20))


def test_a_second_owner_is_refused_until_the_first_closes(make_disk):
    first = make_disk()
    with pytest.raises(DiskTierInUseError, match="in use by another kvrelay process"):
        make_disk()
    first.close()
    make_disk()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda v: v[:HEADER_BYTES + 500] + bytes([v[HEADER_BYTES + 500] ^ 0x01]) + v[HEADER_BYTES + 501:],
                     id="flipped-byte"),
        pytest.param(lambda v: v[: HEADER_BYTES + SPEC.block_bytes // 2], id="truncated"),
        pytest.param(None, id="other-fingerprint"),
    ],
)
def test_a_damaged_value_is_a_miss_deleted_and_counted(make_disk, tmp_path, damage):
    keys = chain(3)
    tier = make_disk()
    for i, key in enumerate(keys):
        tier.put(key, block_value(i))
    tier.close()
    if damage is None:  # a record written by a store of another model under this key
        other = BlockSpec(**{**{f: getattr(SPEC, f) for f in SPEC.__dataclass_fields__}, "model_fingerprint": "x"})
        foreign = make_disk(spec=other, path=tmp_path / "other")
        foreign.put(keys[1], block_value(1))
        foreign.close()
        env = lmdb.open(str(tmp_path / "other"), max_dbs=3)
        with env.begin(db=env.open_db(b"blocks")) as txn:
            foreign_value = bytes(txn.get(keys[1]))
        env.close()
        rewrite_value(tmp_path / "kv", keys[1], lambda _: foreign_value)
    else:
        rewrite_value(tmp_path / "kv", keys[1], damage)
    tier = make_disk()
    assert tier.match_prefix(keys) == 3  # the index does not read values
    assert torch.equal(read(tier, keys[0]), block_value(0))
    assert read(tier, keys[1]) is None
    assert corrupt_count(tier) == 1 and tier.disk_stats().num_corrupt == 1
    assert tier.match_prefix(keys) == 1 and not tier.contains(keys[1])
    tier.flush()
    env_keys = tier.keys_lru_first()
    assert keys[1] not in env_keys and torch.equal(read(tier, keys[2]), block_value(2))
    tier.put(keys[1], block_value(1))  # recomputed and stored again
    assert torch.equal(read(tier, keys[1]), block_value(1))


def test_garbage_over_data_mdb_moves_the_environment_aside(make_disk, tmp_path):
    keys = chain(2)
    tier = make_disk()
    tier.put(keys[0], block_value(0))
    tier.close()
    with open(tmp_path / "kv" / "data.mdb", "r+b") as f:
        f.write(os.urandom(3 * PAGE))
    tier = make_disk()
    assert corrupt_count(tier) == 1
    [moved] = tier.disk_stats().moved_aside
    assert os.path.basename(moved).startswith("kv.corrupt-") and os.path.exists(os.path.join(moved, "data.mdb"))
    assert tier.match_prefix(keys) == 0 and read(tier, keys[0]) is None
    tier.put(keys[1], block_value(1))
    tier.flush()
    assert torch.equal(read(tier, keys[1]), block_value(1))
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700


def test_tiny_map_filled_past_capacity_keeps_serving(make_disk):
    # No watermark headroom: LMDB itself runs out of pages (MDB_MAP_FULL), the writer evicts and retries.
    options = LmdbOptions(high_watermark_frac=1.0, low_watermark_frac=1.0, max_batch_bytes=4 * PAGE,
                          reserved_pages=0)
    tier = make_disk(capacity_bytes=32 * PAGE, options=options)
    keys = chain(120)
    for i, key in enumerate(keys):
        assert tier.put(key, block_value(i))
        if i % 8 == 7:
            tier.flush()
    tier.flush()
    stats = tier.disk_stats()
    assert stats.num_map_full >= 1 and stats.num_evicted > 0
    assert torch.equal(read(tier, keys[-1]), block_value(len(keys) - 1))
    held = tier.keys_lru_first()
    assert 0 < len(held) <= tier.capacity_blocks
    for key in held:
        assert torch.equal(read(tier, key), block_value(keys.index(key)))


def test_a_burst_of_small_blocks_never_fills_the_map(make_disk):
    # Batches stay within the room above the high watermark, so the pages LMDB cannot reuse yet
    # (freed by the previous two commits) never exhaust the map.
    tier = make_disk(capacity_bytes=256 * PAGE)
    keys = chain(1200)
    for i, key in enumerate(keys):
        assert tier.put(key, block_value(i))
    tier.flush()
    stats = tier.disk_stats()
    assert (stats.num_map_full, stats.num_dropped) == (0, 0)
    assert stats.num_blocks <= tier.capacity_blocks and stats.num_evicted == 1200 - stats.num_blocks
    assert torch.equal(read(tier, keys[-1]), block_value(1199))


def test_an_io_error_on_read_is_a_miss_that_keeps_the_entry(make_disk, monkeypatch):
    keys = chain(2)
    tier = make_disk()
    tier.put(keys[0], block_value(0))
    tier.flush()

    def failing_copy(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(lmdb_tier_module, "read_value", failing_copy)
    assert read(tier, keys[0]) is None
    assert tier.contains(keys[0]) and corrupt_count(tier) == 0
    monkeypatch.undo()
    assert torch.equal(read(tier, keys[0]), block_value(0))


def test_a_block_larger_than_the_map_is_refused_at_start(make_disk):
    with pytest.raises(ValueError, match="cannot hold one"):
        make_disk(capacity_bytes=64 * PAGE)


def test_open_read_transactions_are_counted_and_reads_leave_none_open(make_disk):
    keys = chain(3)
    tier = make_disk()
    for i, key in enumerate(keys):
        assert tier.put(key, block_value(i))
    tier.flush()
    assert tier.num_open_read_txns() == 0
    assert all(read(tier, k) is not None for k in keys)
    assert tier.num_open_read_txns() == 0  # the tier's own reads closed their transactions
    txn = tier._opened.env.begin()  # a leaked one is seen
    assert tier.num_open_read_txns() == 1
    txn.abort()
    assert tier.num_open_read_txns() == 0
    tier.close()


def flip_payload_byte(value: bytes) -> bytes:
    return value[: HEADER_BYTES + 500] + bytes([value[HEADER_BYTES + 500] ^ 0x01]) + value[HEADER_BYTES + 501 :]


def bad_magic(value: bytes) -> bytes:
    return b"X" + value[1:]


@pytest.mark.parametrize("checksum", ["xxh3", "pagesum"])
def test_verify_reports_keeps_or_deletes_exactly_the_bad_records(make_disk, tmp_path, checksum):
    options = LmdbOptions(checksum=checksum)
    keys = chain(6)
    tier = make_disk(options=options)
    for i, key in enumerate(keys):
        assert tier.put(key, block_value(i), digest=block_digest(key, block_value(i)))
    tier.close()
    rewrite_value(tmp_path / "kv", keys[1], flip_payload_byte)
    rewrite_value(tmp_path / "kv", keys[4], bad_magic)
    want = sorted([(keys[1], f"{checksum} checksum mismatch"), (keys[4], "bad magic")])
    value_bytes = record_bytes(SPEC.block_bytes, PAGE)
    tier = make_disk(options=options)
    told: list[tuple[bytes, str]] = []
    read_failures: list[bytes] = []
    tier.on_corrupt = lambda key, problem: read_failures.append(key)  # told of bad reads only

    kept = tier.verify(delete=False, on_bad=lambda key, problem: told.append((key, problem)))
    assert [(b.key, b.problem) for b in kept.bad] == want and told == want
    assert (kept.num_checked, kept.checked_bytes, kept.num_deleted) == (6, 6 * value_bytes, 0)
    assert all(tier.contains(k) for k in keys) and corrupt_count(tier) == 0

    told.clear()
    report = tier.verify(on_bad=lambda key, problem: told.append((key, problem)))
    assert [(b.key, b.problem) for b in report.bad] == want and told == want
    assert (report.num_checked, report.checked_bytes, report.num_deleted) == (6, 6 * value_bytes, 2)
    assert [tier.contains(k) for k in keys] == [True, False, True, True, False, True]
    assert corrupt_count(tier) == 2 and tier.disk_stats().num_corrupt == 2
    tier.flush()
    assert tier.read_counters()["disk.corrupt"] == 2
    for i in (0, 2, 3, 5):
        assert torch.equal(read(tier, keys[i]), block_value(i))

    again = tier.verify()
    assert (again.num_checked, again.checked_bytes, again.bad, again.num_deleted) == (4, 4 * value_bytes, (), 0)
    assert corrupt_count(tier) == 2 and read_failures == []
    tier.check_integrity()


def test_verify_reads_in_bounded_transactions_and_checks_each_record_once(make_disk, tmp_path, monkeypatch):
    keys = chain(7)
    tier = make_disk()
    for i, key in enumerate(keys):
        tier.put(key, block_value(i))
    tier.close()
    bad_key = sorted(keys)[3]  # the last record of the second transaction
    rewrite_value(tmp_path / "kv", bad_key, flip_payload_byte)
    monkeypatch.setattr(lmdb_tier_module, "VERIFY_TXN_BYTES", 2 * record_bytes(SPEC.block_bytes, PAGE))
    tier = make_disk()
    opened = []
    real_read_txn = tier._read_txn

    def counting_read_txn():
        opened.append(tier.num_open_read_txns())
        return real_read_txn()

    monkeypatch.setattr(tier, "_read_txn", counting_read_txn)
    report = tier.verify()
    assert opened == [0, 0, 0, 0]  # 2 + 2 + 2 + 1 records, one transaction at a time
    assert report.num_checked == 7 and report.bad == (lmdb_tier_module.BadRecord(bad_key, "pagesum checksum mismatch"),)
    assert report.num_deleted == 1 and not tier.contains(bad_key) and tier.num_open_read_txns() == 0


def test_verify_checks_records_still_queued_once_flushed(make_disk):
    keys = chain(3)
    tier = make_disk(options=LmdbOptions(checksum="xxh3"))
    for i, key in enumerate(keys):
        tier.put(key, block_value(i))
    report = tier.verify()
    assert (report.num_checked, report.bad, report.num_deleted) == (3, (), 0)
