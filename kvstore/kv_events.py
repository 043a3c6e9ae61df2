"""`KvEventLog`: numbered "block stored / removed" events a node publishes for KV-aware routing.

A subscriber asks for the events after the last sequence number it saw. If those have already
fallen out of the bounded log (it joined late or fell behind) it gets a snapshot of every key the
node holds instead, with the sequence number the snapshot is current to.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvstore.block_key import BlockKey

STORED = "stored"
REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class KvEvent:
    seq: int
    kind: str  # STORED | REMOVED
    key: BlockKey


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Either ``events`` (contiguous after the asked-for seq) or, on a gap, ``snapshot`` keys."""

    last_seq: int
    events: list[KvEvent] | None
    snapshot: list[BlockKey] | None


class KvEventLog:
    """Thread-safe; fed by a `BlockPool` (as its `PoolListener`) on the engine thread, read from asyncio.

    Args:
        capacity: events kept; older ones are only available through a snapshot.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self._lock = threading.Lock()
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._keys: set[BlockKey] = set()
        self._seq = 0

    def _add(self, kind: str, key: BlockKey) -> None:
        with self._lock:
            self._seq += 1
            self._events.append(KvEvent(self._seq, kind, key))
            if kind == STORED:
                self._keys.add(key)
            else:
                self._keys.discard(key)

    def block_stored(self, block_id: int, key: BlockKey) -> None:
        self._add(STORED, key)

    def block_removed(self, block_id: int, key: BlockKey) -> None:
        self._add(REMOVED, key)

    @property
    def last_seq(self) -> int:
        return self._seq

    def since(self, after: int, *, limit: int = 4096) -> EventBatch:
        """Events with ``seq > after`` (at most ``limit``), or a snapshot if some were dropped."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self._seq + 1
            if after < oldest - 1 or after > self._seq:
                return EventBatch(self._seq, None, sorted(self._keys))
            events = [e for e in self._events if e.seq > after][:limit]
            last = events[-1].seq if events else self._seq
            return EventBatch(last, events, None)
