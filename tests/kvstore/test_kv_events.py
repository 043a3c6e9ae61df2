"""KV events: numbered stored/removed events, and a snapshot for a late or lagging subscriber."""

from __future__ import annotations

from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.kvstore.kv_events import REMOVED, STORED, KvEventLog
from kvrelay.router.kv_index import KvIndex


def key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 32)


def test_pool_events_in_order_then_snapshot_on_gap():
    log = KvEventLog(capacity=3)
    pool = BlockPool(3)
    pool.add_listener(log)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register_key(b, key(i))
    pool.release(blocks)  # cached, tail first in LRU: 2, 1, 0
    pool.allocate(1)  # evicts block 2 (key 2)
    batch = log.since(0)
    assert batch.events is None and sorted(batch.snapshot) == [key(0), key(1)]  # seq 1 fell out of the log
    batch = log.since(1)
    assert [(e.seq, e.kind, e.key) for e in batch.events] == [
        (2, STORED, key(1)), (3, STORED, key(2)), (4, REMOVED, key(2))]
    assert log.since(4).events == [] and log.since(4).last_seq == 4
    assert log.since(99).snapshot is not None  # a subscriber ahead of us: the node restarted


def test_index_follows_events_and_snapshots():
    log = KvEventLog()
    idx = KvIndex()
    for i in range(3):
        log.block_stored(i, key(i))
    b = log.since(0)
    idx.apply("n", [e.key for e in b.events if e.kind == STORED], [e.key for e in b.events if e.kind == REMOVED],
              b.last_seq)
    assert idx.prefix_blocks([key(0), key(1), key(2)], ["n"]) == {"n": 3}
    log.block_removed(1, key(1))
    b = log.since(idx.node_to_last_seq["n"])
    idx.apply("n", [], [e.key for e in b.events if e.kind == REMOVED], b.last_seq)
    assert idx.prefix_blocks([key(0), key(1), key(2)], ["n"]) == {"n": 1}
    idx.replace("n", log.since(-5).snapshot, log.last_seq)
    assert idx.num_keys("n") == 2


def test_notify_after_fires_once_on_the_next_event_and_cancel_forgets():
    log = KvEventLog()
    log.block_stored(0, key(0))
    calls: list[str] = []
    assert not log.notify_after(0, lambda: calls.append("late"))  # seq 1 is already past 0: ask `since`
    assert log.notify_after(1, lambda: calls.append("a"))
    dropped = lambda: calls.append("dropped")  # noqa: E731
    assert log.notify_after(1, dropped)
    log.cancel(dropped)
    log.block_removed(0, key(0))
    log.block_stored(1, key(1))
    assert calls == ["a"]
