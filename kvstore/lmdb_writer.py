"""`LmdbWriter`: the one writer thread of an `LmdbTier`, committing queued ops in batched transactions.

::

    submit(Put | Delete | Barrier | Stop) ──▶ queue ──▶ [op, op, … ≤ max_batch_bytes] ──▶ one write txn
                                                        deletes, then puts (+ access sequence),
                                                        touched keys' access sequence, counters

Deletes go first in a transaction: for any key, a Put still current in the tier's index is the last
thing that happened to it (an eviction or discard removes the entry from the index before queueing
its Delete), so "deletes, then current puts" reproduces the op order. Stale puts are skipped.

On ``MDB_MAP_FULL`` the writer evicts LRU blocks (in their own commit, plus one more commit so LMDB
may reuse the freed pages) and retries once; if that fails too the batch's puts are dropped.

A commit that fails with an I/O error (the disk is full: ENOSPC, or EIO for a write LMDB found cut
short) drops the batch's puts and starts a back-off: no commit is tried for ``write_backoff_min_s``,
doubling after each further failure up to ``write_backoff_max_s``; batches that arrive meanwhile have
their puts dropped (counted) and their deletes kept for later, without touching the disk. The wait
goes back to the minimum once a whole ``write_backoff_max_s`` has passed without a failure (a nearly full disk
lets small commits through between failures). Readers are unaffected throughout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import lmdb
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_record import RecordCodec
from kvrelay.kvstore.disk_index import DiskIndex, Entry
from kvrelay.kvstore.lmdb_env import CORRUPTION_ERRORS, LmdbOptions, OpenedEnv, pack_access, read_u64, u64

log = logging.getLogger(__name__)
_MAX_BATCH_OPS = 4096
_MAX_MAP_FULL_STREAK = 3



class WriterHost(Protocol):
    """The tier members the writer uses (`kvstore.lmdb_tier.LmdbTier` provides them)."""

    path: object  # shown in log lines
    options: LmdbOptions
    index: DiskIndex

    @property
    def headroom_bytes(self) -> int: ...

    @property
    def record_disk_bytes(self) -> int: ...

    @property
    def map_lock(self) -> threading.Lock: ...

    def grow_map_locked(self) -> bool: ...

    def request_reset(self, reason: str, *, corrupt: bool) -> None: ...

    def note_dropped(self, n: int) -> None: ...

    def note_write_error(self) -> None: ...

    def note_map_full(self, num_evicted: int) -> None: ...

@dataclass(frozen=True, slots=True)
class Put:
    key: BlockKey
    entry: Entry


@dataclass(frozen=True, slots=True)
class Delete:
    key: BlockKey


@dataclass(frozen=True, slots=True)
class Barrier:
    """Forces a batch (persisting access order and counters); `flush` waits for it."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Last op: the thread exits after the batch that holds it."""


Op = Put | Delete | Barrier | Stop


class LmdbWriter:
    """Applies ops to ``opened`` from one daemon thread.

    Each batch also persists the access order of keys the tier touched and its counter deltas
    (`LmdbTier.take_batch_state_locked`).
    """

    def __init__(self, opened: OpenedEnv, codec: RecordCodec, *, tier: WriterHost) -> None:
        self._opened = opened
        self._codec = codec
        self._tier = tier
        self._index = tier.index
        self._queue: queue.SimpleQueue[Op] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = 0  # under _cond
        self._completed = 0  # under _cond
        self.pending_put_bytes = 0  # under _cond; read without it as a hint
        self._deferred_deletes: list[BlockKey] = []  # deletes a full map refused; retried first
        # Pages freed by a commit are reusable only two commits later, so the map must hold, above the
        # high watermark, what the last three commits wrote: their blocks and the leaf pages they copied
        # on write. Keys are random, so every op (put, delete, access-time update) copies about one leaf
        # page per sub-database it touches: ~4 pages per op with its access-time update, 12 for three
        # commits. A batch gets an eighth of the room in bytes and one op per 24 pages of it (measured:
        # a third of the room without an op limit wedged a map of 2 KiB blocks).
        headroom = tier.headroom_bytes
        self._max_batch_bytes = max(tier.record_disk_bytes, min(tier.options.max_batch_bytes, headroom // 8))
        self._max_batch_ops = max(1, min(_MAX_BATCH_OPS, headroom // (24 * opened.page_bytes)))
        self._map_full_streak = 0  # batches in a row that MDB_MAP_FULL refused
        self._backoff_s = 0.0  # after a failed commit: the wait before the next attempt
        self._retry_at = 0.0  # time.monotonic() before which no commit is attempted
        self._failed_at = -float("inf")  # time.monotonic() of the last failed commit
        self._thread = threading.Thread(target=self._run, name=f"kvrelay-lmdb-writer:{tier.path}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, op: Op) -> None:
        with self._cond:
            self._submitted += 1
            self.pending_put_bytes += op.entry.disk_bytes if isinstance(op, Put) else 0
        self._queue.put(op)

    def flush(self, timeout_s: float) -> None:
        """Wait until every op submitted so far is applied.

        Raises:
            TimeoutError: not done within ``timeout_s``.
        """
        if not self._thread.is_alive():
            return
        self.submit(Barrier())
        with self._cond:
            target = self._submitted
            done = self._cond.wait_for(
                lambda: self._completed >= target or not self._thread.is_alive(), timeout=timeout_s
            )
        if not done:
            raise TimeoutError(f"disk tier writer did not commit within {timeout_s} s")

    def stop(self, timeout_s: float) -> None:
        """Apply everything queued, then end the thread. Idempotent.

        Raises:
            TimeoutError: the thread did not end within ``timeout_s``.
        """
        if not self._thread.is_alive():
            return
        self.submit(Stop())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"disk tier writer did not stop within {timeout_s} s")

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        stop = False
        interval_s = self._tier.options.stale_reader_check_s
        next_check = time.monotonic() + interval_s
        while not stop:
            if time.monotonic() >= next_check:
                self._clear_stale_readers()
                next_check = time.monotonic() + interval_s
            try:
                batch: list[Op] = [self._queue.get(timeout=max(0.0, next_check - time.monotonic()))]
            except queue.Empty:
                continue
            batch_bytes = 0
            while batch_bytes < self._max_batch_bytes and len(batch) < self._max_batch_ops:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(op)
                batch_bytes += op.entry.disk_bytes if isinstance(op, Put) else 0
            stop = any(isinstance(op, Stop) for op in batch)
            try:
                self._apply(batch)
                if any(isinstance(op, Barrier | Stop) for op in batch):
                    self._persist_all_touched()
            except Exception:
                log.exception("disk tier %s: writer batch failed", self._tier.path)
            with self._cond:
                self._completed += len(batch)
                self.pending_put_bytes -= sum(op.entry.disk_bytes for op in batch if isinstance(op, Put))
                self._cond.notify_all()

    def _clear_stale_readers(self) -> None:
        """Free the reader slots of dead processes, so that new processes can open the environment."""
        try:
            cleared = self._opened.env.reader_check()
        except lmdb.Error as exc:
            log.warning("disk tier %s: reader check failed (%s)", self._tier.path, exc)
            return
        if cleared:
            log.info("disk tier %s: cleared %d stale LMDB readers", self._tier.path, cleared)

    def _apply(self, batch: list[Op]) -> None:
        tier = self._tier
        puts: list[Put] = []
        deletes: list[BlockKey] = []
        backing_off = self._backing_off()  # the disk failed a moment ago: do not try it again yet
        with self._index.lock:
            for op in batch:
                if isinstance(op, Put) and self._index.entry_of_locked(op.key) is op.entry:
                    puts.append(op)
                elif isinstance(op, Delete):
                    deletes.append(op.key)
            if backing_off:
                touched_keys, deltas = [], {}
            else:
                # Access order goes out oldest touch first, within the batch's op budget.
                touched_keys, deltas = self._index.take_batch_state_locked(max(1, self._max_batch_ops - len(batch)))
            put_keys = {op.key for op in puts}
            touched = [
                (k, e.seq, e.disk_bytes) for k in touched_keys if (e := self._stored_entry(k, put_keys)) is not None
            ]
        if backing_off:
            self._deferred_deletes += deletes
            self._drop(puts)
            return
        deletes, self._deferred_deletes = self._deferred_deletes + deletes, []
        if not (puts or deletes or touched or deltas):
            return
        for op in puts:
            assert op.entry.record is not None
            self._codec.seal(op.entry.record, op.entry.digest)
        try:
            try:
                self._write(puts, deletes, touched, deltas)
            except lmdb.MapFullError:
                self._evict_and_retry(puts, deletes, touched, deltas)
        except CORRUPTION_ERRORS as exc:
            log.error("disk tier %s: LMDB reports corruption while writing (%s)", tier.path, exc)
            tier.request_reset(f"LMDB reported corruption: {exc}", corrupt=True)
            self._drop(puts)
            return
        except lmdb.MapFullError as exc:
            self._map_full_streak += 1
            log.error("disk tier %s: map still full after evicting (%s); %d blocks not stored",
                      tier.path, exc, len(puts))
            self._drop(puts)
            if self._map_full_streak >= _MAX_MAP_FULL_STREAK:  # wedged: nothing can be freed any more
                tier.request_reset(f"LMDB map full in {self._map_full_streak} batches in a row", corrupt=False)
            return
        except (lmdb.Error, OSError) as exc:
            self._deferred_deletes = deletes + self._deferred_deletes  # their keys are out of the index
            self._drop(puts)
            self._write_failed(exc, len(puts))
            return
        self._map_full_streak = 0
        with self._index.lock:
            for op in puts:
                op.entry.record = None

    def _backing_off(self) -> bool:
        return time.monotonic() < self._retry_at

    def _write_failed(self, exc: BaseException, num_puts: int) -> None:
        """A commit failed with an I/O error: count it and wait twice as long as last time before the next."""
        options, now = self._tier.options, time.monotonic()
        # A nearly full disk takes some small commits between failures: the wait goes back to the minimum
        # only after a whole maximum wait without a failure.
        last_s = self._backoff_s if now - self._failed_at <= self._backoff_s + options.write_backoff_max_s else 0.0
        self._backoff_s = min(options.write_backoff_max_s, max(options.write_backoff_min_s, 2 * last_s))
        self._retry_at = self._failed_at = now
        self._retry_at += self._backoff_s
        self._tier.note_write_error()
        log.error("disk tier %s: write failed (%s); %d blocks not stored; next write in %.2f s, blocks queued until "
                  "then are dropped", self._tier.path, exc, num_puts, self._backoff_s)

    def _persist_all_touched(self) -> None:
        """For flush and stop: write the access order of every touched key, a batch's worth per commit
        (none while backing off: they stay touched, for a later batch)."""
        while not self._backing_off():
            with self._index.lock:
                if not self._index.has_touched_locked():
                    return
            self._apply([])

    def _stored_entry(self, key: BlockKey, put_keys: set[BlockKey]) -> Entry | None:
        """Under ``index.lock``: the key's entry if it is committed or put in this batch (a later put
        writes its latest access itself)."""
        entry = self._index.entry_of_locked(key)
        return entry if entry is not None and (entry.record is None or key in put_keys) else None

    def _evict_and_retry(
        self, puts: list[Put], deletes: list[BlockKey], touched: list[tuple[BlockKey, int, int]], deltas: dict[str, int]
    ) -> None:
        tier = self._tier
        need = 2 * sum(op.entry.disk_bytes for op in puts) + 2 * self._opened.page_bytes
        with self._index.lock:
            victims = self._index.evict_lru_locked(need, keep={op.key for op in puts})
        tier.note_map_full(len(victims))
        log.warning("disk tier %s: LMDB map full; evicted %d blocks and retrying", tier.path, len(victims))
        # Retry with no reader of this process holding an old snapshot, which would keep LMDB from reusing
        # the pages freed since (readers wait for these few commits; this path is rare).
        with tier.map_lock:
            try:
                try:
                    self._write([], deletes + victims, [], {})
                except lmdb.MapFullError:
                    # Deleting copies pages too: with none left, LMDB can free nothing. Grow the map a
                    # little (within LmdbTier's slack) so the deletes go through and their pages come back.
                    if not tier.grow_map_locked():
                        raise
                    self._write([], deletes + victims, [], {})
                self._write([], [], [], {"ticks": 1})  # one more commit: LMDB reuses freed pages after it
            except lmdb.MapFullError:
                # Still no room: keep the deletes for the next batch (the keys are out of the index
                # already) and give up this batch's puts.
                self._deferred_deletes = deletes + victims
                raise
            self._write(puts, [], touched, deltas)

    def _drop(self, puts: list[Put]) -> None:
        tier = self._tier
        for op in puts:
            self._index.forget_entry(op.key, op.entry)
        tier.note_dropped(len(puts))

    def _write(
        self, puts: list[Put], deletes: list[BlockKey], touched: list[tuple[BlockKey, int, int]], deltas: dict[str, int]
    ) -> None:
        o = self._opened
        with o.env.begin(write=True) as txn:
            for key in deletes:
                txn.delete(key, db=o.blocks)
                txn.delete(key, db=o.atime)
            for op in puts:
                txn.put(op.key, op.entry.record, db=o.blocks)
                txn.put(op.key, pack_access(op.entry.seq, op.entry.disk_bytes), db=o.atime)
            for key, seq, disk_bytes in touched:
                txn.put(key, pack_access(seq, disk_bytes), db=o.atime)
            for name, d in deltas.items():
                k = b"count." + name.encode()
                txn.put(k, u64(read_u64(txn.get(k, db=o.meta)) + d), db=o.meta)
