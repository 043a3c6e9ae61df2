"""`DiskIndex`: the in-memory index of the ``disk`` tier, shared by the caller and writer threads.

::

    _key_to_entry (OrderedDict, LRU first):  key_a → Entry(disk_bytes, seq, record=None)      committed
                                             key_b → Entry(disk_bytes, seq, record=bytearray)  queued
    _touched:        keys read or refreshed whose access sequence is not persisted yet (oldest first)
    _counter_deltas: lifetime counters not persisted yet

It is the truth for `contains`/`match_prefix`: a block is indexed from the moment it is queued, and
leaves the index before its delete is queued. Every field is guarded by ``lock``; methods whose names
end in ``_locked`` expect the caller to hold it, the others take it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvrelay.kvstore.block_key import BlockKey


@dataclass(slots=True)
class Entry:
    """One indexed block. ``record`` is set while it waits for the writer and None once committed;
    ``seq`` is its last access in the index's access sequence (persisted in ``atime``)."""

    disk_bytes: int
    seq: int
    record: bytearray | None = None
    digest: int | None = None  # the block's digest, once known (given to put, or read from its record)


class DiskIndex:
    """Key → `Entry` in LRU order, with the bytes they take and what the writer still has to persist."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._key_to_entry: OrderedDict[BlockKey, Entry] = OrderedDict()  # first = least recently used
        self._used_bytes = 0
        self._next_seq = 1
        self._touched: dict[BlockKey, None] = {}
        self._counter_deltas: dict[str, int] = {}

    def load(self, key_to_access: Mapping[bytes, tuple[int, int]], *, default_disk_bytes: int) -> None:
        """Replace the contents with ``key → (seq, disk_bytes)`` (disk_bytes 0: ``default_disk_bytes``)."""
        with self.lock:
            self._key_to_entry.clear()
            self._used_bytes = 0
            for key, (seq, disk_bytes) in sorted(key_to_access.items(), key=lambda kv: (kv[1][0], kv[0])):
                entry = Entry(disk_bytes or default_disk_bytes, seq)
                self._key_to_entry[BlockKey(key)] = entry
                self._used_bytes += entry.disk_bytes
            self._next_seq = max((seq for seq, _ in key_to_access.values()), default=0) + 1

    # ----------------------------------------------------------------- queries
    def contains(self, key: BlockKey) -> bool:
        return key in self._key_to_entry  # one dict lookup: atomic under the GIL

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            if key not in self._key_to_entry:
                break
            n += 1
        return n

    def keys_lru_first(self) -> list[BlockKey]:
        with self.lock:
            return list(self._key_to_entry)

    def sizes(self) -> tuple[int, int, int]:
        """``(blocks, used bytes, blocks still queued)``."""
        with self.lock:
            pending = sum(1 for e in self._key_to_entry.values() if e.record is not None)
            return len(self._key_to_entry), self._used_bytes, pending

    def snapshot(self) -> tuple[dict[bytes, Entry], int]:
        """A copy of the index and the used bytes (for integrity checks)."""
        with self.lock:
            return {bytes(k): e for k, e in self._key_to_entry.items()}, self._used_bytes

    def get(self, key: BlockKey) -> Entry | None:
        """``key``'s entry without touching it."""
        return self._key_to_entry.get(key)

    # --------------------------------------------------------------- mutations
    def touch(self, key: BlockKey) -> Entry | None:
        """Mark ``key`` most recently used (to be persisted); its entry, or None if not indexed."""
        with self.lock:
            entry = self._key_to_entry.get(key)
            if entry is not None:
                self._key_to_entry.move_to_end(key)
                entry.seq = self._tick_locked()
                self._touched.pop(key, None)
                self._touched[key] = None
            return entry

    def _tick_locked(self) -> int:
        self._next_seq += 1
        return self._next_seq

    def add(self, key: BlockKey, entry: Entry, *, high_bytes: int, low_bytes: int) -> list[BlockKey] | None:
        """Index a new (queued) ``entry``. If it would pass ``high_bytes``, least recently used entries
        are evicted first until it fits under ``low_bytes``. Returns the evicted keys, or None (nothing
        changed) when one entry alone is larger than ``high_bytes``."""
        need = entry.disk_bytes
        if need > high_bytes:
            return None
        victims: list[BlockKey] = []
        with self.lock:
            if self._used_bytes + need > high_bytes:
                while self._key_to_entry and self._used_bytes + need > low_bytes:
                    victim, old = self._key_to_entry.popitem(last=False)
                    self._used_bytes -= old.disk_bytes
                    victims.append(victim)
            entry.seq = self._tick_locked()
            self._key_to_entry[key] = entry
            self._used_bytes += need
        return victims

    def discard(self, key: BlockKey) -> Entry | None:
        """Forget ``key``; its entry, or None if it was not indexed."""
        with self.lock:
            entry = self._key_to_entry.pop(key, None)
            if entry is not None:
                self._used_bytes -= entry.disk_bytes
            return entry

    def forget_entry(self, key: BlockKey, entry: Entry) -> None:
        """Forget ``key`` if ``entry`` is still its entry (a write of it that failed)."""
        with self.lock:
            if self._key_to_entry.get(key) is entry:
                del self._key_to_entry[key]
                self._used_bytes -= entry.disk_bytes

    def add_counters(self, deltas: Mapping[str, int]) -> None:
        with self.lock:
            for name, d in deltas.items():
                if d:
                    self._counter_deltas[name] = self._counter_deltas.get(name, 0) + d

    # ------------------------------------------------------------ writer side
    def entry_of_locked(self, key: BlockKey) -> Entry | None:
        return self._key_to_entry.get(key)

    def evict_lru_locked(self, need: int, keep: Iterable[BlockKey]) -> list[BlockKey]:
        """Drop least recently used entries not in ``keep`` until ``need`` bytes are freed."""
        keep = set(keep)
        victims: list[BlockKey] = []
        freed = 0
        for key in list(self._key_to_entry):
            if freed >= need:
                break
            if key in keep:
                continue
            freed += self._key_to_entry.pop(key).disk_bytes
            victims.append(key)
        self._used_bytes -= freed
        return victims

    def take_batch_state_locked(self, max_touched: int) -> tuple[list[BlockKey], dict[str, int]]:
        """The ``max_touched`` least recently touched keys not persisted yet (the rest wait) and the
        counter deltas since the last batch."""
        keys = list(self._touched)
        taken, rest = keys[:max_touched], keys[max_touched:]
        self._touched = dict.fromkeys(rest)
        deltas, self._counter_deltas = self._counter_deltas, {}
        return taken, deltas

    def has_touched_locked(self) -> bool:
        return bool(self._touched)
