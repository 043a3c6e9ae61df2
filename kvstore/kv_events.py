"""`KvEventLog`: numbered "block stored / removed" events a node publishes for KV-aware routing.

A subscriber asks for the events after the last sequence number it saw. If those have already
fallen out of the bounded log (it joined late or fell behind) it gets a snapshot of every key the
node holds instead, with the sequence number the snapshot is current to. A subscriber that is
current can wait for the next event (`notify_after`) instead of asking again and again.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.kvstore.block_key import BlockKey

STORED = "stored"
REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class KvEvent:
    seq: int
    kind: str  # STORED | REMOVED
    key: BlockKey
    digest: int | None = None  # STORED: the block's digest (`kvstore.digest`); None when integrity is off


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
        self._waiters: list[Callable[[], None]] = []  # one-shot, see notify_after

    def _add(self, kind: str, key: BlockKey, digest: int | None = None) -> None:
        with self._lock:
            self._seq += 1
            self._events.append(KvEvent(self._seq, kind, key, digest))
            if kind == STORED:
                self._keys.add(key)
            else:
                self._keys.discard(key)
            waiters, self._waiters = self._waiters, []
        for notify in waiters:
            notify()

    def notify_after(self, seq: int, notify: Callable[[], None]) -> bool:
        """Call ``notify()`` once, on the writer's thread, when an event past ``seq`` is added.

        Returns False (and keeps nothing) if there already is one; then call `since`. ``notify`` must
        be quick and thread-safe (e.g. ``loop.call_soon_threadsafe(event.set)``). Drop it with `cancel`.
        """
        with self._lock:
            if self._seq > seq:
                return False
            self._waiters.append(notify)
            return True

    def cancel(self, notify: Callable[[], None]) -> None:
        """Forget a ``notify`` given to `notify_after` that has not been called (no-op otherwise)."""
        with self._lock:
            if notify in self._waiters:
                self._waiters.remove(notify)

    def block_stored(self, block_id: int, key: BlockKey, digest: int | None = None) -> None:
        self._add(STORED, key, digest)

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
