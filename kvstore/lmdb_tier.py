"""`LmdbTier`: the ``disk`` tier — one LMDB environment per process, persistent and checksummed.

Who does what::

    caller thread (engine)                         writer thread (one per LmdbTier)
    ──────────────────────                         ────────────────────────────────
    put:  copy block → record (one memcpy),        batches up to max_batch_bytes of ops per
          index it (readable at once), pick LRU    transaction: seal (checksum) records, put
          victims past the high watermark,         blocks and access order, delete victims,
          queue Put/Delete ─────────────────────▶  add lifetime counters, commit;
    get_into: zero-copy read txn, check header     MDB_MAP_FULL → evict more, retry once
          and checksum, copy into dst

* The in-memory `DiskIndex` (LRU order) is the truth for `contains`/`match_prefix`; a queued record is
  served from memory until committed. The index is shared with the writer thread (it has its own
  lock); the counters below are guarded by the index's lock; everything else is the caller thread's.
* Any header mismatch or checksum failure is a miss, the entry is deleted and
  ``kvrelay_store_corrupt_total`` counts it: never wrong KV. An I/O error on read is a miss that keeps
  the entry. LMDB reporting corruption moves the environment aside and starts a fresh one.
* A full write queue (``max_pending_bytes`` of records) drops the write rather than block the caller.
* A disk that fails (full, not writable, I/O errors) never stops the caller: opening raises
  `DiskTierUnavailableError` (the store then runs without the tier); a failed commit makes the writer
  back off (`LmdbOptions`); a fresh start after corruption that fails leaves the tier *unavailable*: it
  holds nothing, refuses puts (counted as dropped) and says why (`unavailable_reason`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np
import torch
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_mover import Block, copy_block
from kvrelay.kvstore.block_record import HEADER_BYTES, RecordCodec, entry_bytes
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.digest import block_digest
from kvrelay.kvstore.disk_index import DiskIndex, Entry
from kvrelay.kvstore.lmdb_env import (
    CORRUPTION_ERRORS,
    DiskTierUnavailableError,
    LmdbOptions,
    OpenedEnv,
    OwnerLock,
    enable_readahead,
    errno_name,
    keep_block_buffers_on_heap,
    move_aside,
    open_env,
    read_u64,
    unpack_access,
)
from kvrelay.kvstore.lmdb_writer import Delete, LmdbWriter, Put
from kvrelay.kvstore.metrics import StoreMetrics
from kvrelay.kvstore.tier import TierStats

# LmdbOptions lives in lmdb_env (the writer uses it too)
__all__ = ["BadRecord", "DiskStats", "LmdbOptions", "LmdbTier", "VerifyReport"]
log = logging.getLogger(__name__)
DEFAULT_OPTIONS = LmdbOptions()
MAP_SLACK_FRAC = 0.1  # how far past disk.bytes `grow_map` may take the map, to let evictions through
VERIFY_TXN_BYTES = 64 << 20  # values one `verify` read transaction checks: bounds how long it pins a snapshot


@dataclass(frozen=True, slots=True)
class DiskStats:
    """Occupancy and lifetime counters of the disk tier (counters since this process opened it)."""

    path: str
    num_blocks: int
    capacity_blocks: int
    block_bytes: int
    used_bytes: int
    map_bytes: int
    file_bytes: int
    num_pending: int
    num_corrupt: int
    num_dropped: int
    num_evicted: int
    num_map_full: int
    moved_aside: tuple[str, ...]
    num_write_errors: int = 0

    @property
    def free_bytes(self) -> int:
        return max(0, self.map_bytes - self.used_bytes)


@dataclass(slots=True)
class _Counts:
    corrupt: int = 0
    dropped: int = 0
    evicted: int = 0
    map_full: int = 0
    write_errors: int = 0
    moved_aside: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A stored record that `LmdbTier.verify` found bad, and why (a `RecordCodec.problem` text)."""

    key: BlockKey
    problem: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `LmdbTier.verify` found: records checked and the bytes of their values, the bad ones in key
    order, how many of those it deleted, and the seconds it took (flush included)."""

    num_checked: int
    checked_bytes: int
    bad: tuple[BadRecord, ...]
    num_deleted: int
    elapsed_s: float


@dataclass(slots=True)
class _VerifyPass:
    """Progress of one `LmdbTier.verify` across its read transactions."""

    after: bytes | None = None  # the last key checked; the next transaction resumes past it
    num_checked: int = 0
    checked_bytes: int = 0
    bad: list[BadRecord] = field(default_factory=list)


def read_value(value: memoryview, header: bytearray, payload: np.ndarray) -> None:
    """Copy a stored value's header and payload out of LMDB's map (inside the read transaction that
    returned ``value``, whose pages cannot change meanwhile)."""
    header[:] = value[: len(header)]
    np.copyto(payload, np.frombuffer(value, dtype=np.uint8, count=payload.nbytes, offset=len(header)))


class LmdbTier:
    """Blocks keyed by `BlockKey` in the LMDB environment at ``path``.

    Args:
        spec: block layout; the fingerprint is in every record.
        path: environment directory (created, mode 0700).
        capacity_bytes: LMDB ``map_size`` (rounded up to whole pages).
        metrics: where to count corruption, drops and evictions (fresh metrics if None).
        options: watermarks, queue and batch sizes, checksum.

    Raises:
        DiskTierInUseError: another process owns ``path``.
        DiskTierUnavailableError: the disk cannot hold or serve the tier: full, not writable, an I/O
            error (a corrupt environment is moved aside and started afresh instead).
        ValueError: ``capacity_bytes`` cannot hold one block.
    """

    name = "disk"

    def __init__(
        self, spec: BlockSpec, path: str | Path, *, capacity_bytes: int, metrics: StoreMetrics | None = None,
        options: LmdbOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.spec = spec
        self.path = Path(path)
        self.options = options
        self.metrics = metrics if metrics is not None else StoreMetrics.create()
        self.index = DiskIndex()
        self._counts = _Counts()  # under index.lock
        self._needs_reset = threading.Event()
        self._closed = False
        self._reset_reason = "LMDB reported corruption"
        self.unavailable_reason: str | None = None  # set when a fresh start failed: the tier is out of use
        self.on_corrupt: Callable[[BlockKey, str], None] | None = None  # told of every bad record deleted
        self._staging = (
            torch.empty(spec.block_bytes, dtype=torch.uint8, pin_memory=True) if torch.cuda.is_available() else None
        )
        self._map_bytes = -(-capacity_bytes // 4096) * 4096
        self._configured_map_bytes = self._map_bytes
        self._map_lock = threading.Lock()  # held by read transactions and by grow_map
        try:
            self._owner = OwnerLock(self.path)
        except OSError as exc:
            raise self._unavailable(exc) from exc
        try:
            self._start()
            keep_block_buffers_on_heap(self._codec.value_bytes)
        except (OSError, lmdb.Error) as exc:
            self._owner.release()
            raise self._unavailable(exc) from exc
        except BaseException:
            self._owner.release()
            raise
        if self._high_bytes < self._record_disk_bytes:
            self.close()
            raise ValueError(
                f"disk tier capacity {capacity_bytes} bytes cannot hold one {spec.block_bytes}-byte block; "
                f"raise kvstore.disk.bytes"
            )

    def _start(self) -> None:
        """Open the environment (moving a corrupt one aside), load the index, start the writer."""
        try:
            opened = self._open_env()
            self._load_index(opened)
        except CORRUPTION_ERRORS as exc:
            self._note_corrupt_env(exc)  # open_env or _load_index closed it
            opened = self._open_env()
            self._load_index(opened)
        self._opened = opened
        enable_readahead(self.path / "data.mdb")
        self._writer = LmdbWriter(opened, self._codec, tier=self)
        self._writer.start()

    def _unavailable(self, exc: BaseException) -> DiskTierUnavailableError:
        return DiskTierUnavailableError(
            f"disk tier {self.path} cannot be opened ({type(exc).__name__}: {exc}); free space on that disk or "
            f"fix its permissions (kvstore.disk.path), then restart the node", errno_name(exc))

    def _open_env(self) -> OpenedEnv:
        opened = open_env(
            self.path, map_bytes=self._configured_map_bytes, max_readers=self.options.max_readers,
            block_bytes=self.spec.block_bytes,
        )
        self._codec = RecordCodec(self.spec, opened.page_bytes, self.options.checksum)
        self._record_disk_bytes = entry_bytes(self._codec.value_bytes, opened.page_bytes)
        self._map_bytes = self._configured_map_bytes
        usable = max(0, self._map_bytes - self.options.reserved_pages * opened.page_bytes)
        self._high_bytes = int(usable * self.options.high_watermark_frac)
        self._low_bytes = int(usable * self.options.low_watermark_frac)
        return opened

    def _note_corrupt_env(self, exc: BaseException) -> None:
        moved = str(move_aside(self.path, f"{type(exc).__name__}: {exc}"))
        self._count("corrupt")
        with self.index.lock:
            self._counts.moved_aside.append(moved)

    def _count(self, name: str, n: int = 1) -> None:
        """Count ``n`` events in memory, in the metrics and (with the next batch) in ``meta``."""
        if n <= 0:
            return
        with self.index.lock:
            setattr(self._counts, name, getattr(self._counts, name) + n)
        self.index.add_counters({f"disk.{name}": n})
        if name == "corrupt":
            self.metrics.store_corrupt.inc(n)
        elif name == "dropped":
            self.metrics.dropped_writes.inc(n)
        elif name == "evicted":
            self.metrics.tier_evictions.labels("disk").inc(n)
        elif name == "write_errors":
            self.metrics.disk_write_errors.inc(n)

    def _load_index(self, opened: OpenedEnv) -> None:
        """Index every stored block in its persisted access order, from the ``atime`` records alone (one
        per block, written with it): a cursor over ``blocks`` would touch every value. Closes
        ``opened`` if it is corrupt."""
        try:
            with opened.env.begin(buffers=True) as txn:
                key_to_access = {bytes(k): unpack_access(v) for k, v in txn.cursor(db=opened.atime).iternext()}
        except CORRUPTION_ERRORS:
            opened.env.close()
            raise
        self.index.load(key_to_access, default_disk_bytes=self._record_disk_bytes)

    # ----------------------------------------------------------------- queries
    def contains(self, key: BlockKey) -> bool:
        return self.index.contains(key)

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        return self.index.match_prefix(keys)

    def keys_lru_first(self) -> list[BlockKey]:
        return self.index.keys_lru_first()

    @property
    def record_disk_bytes(self) -> int:
        """Bytes of the map one block takes: its overflow pages plus its share of leaf pages."""
        return self._record_disk_bytes

    @property
    def headroom_bytes(self) -> int:
        """Map bytes above the high watermark, free for pages LMDB cannot reuse yet."""
        return self._map_bytes - self._high_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._high_bytes // self._record_disk_bytes

    def stats(self) -> TierStats:
        return TierStats(self.name, self.index.sizes()[0], self.capacity_blocks, self.spec.block_bytes)

    def num_open_read_txns(self) -> int:
        """Read transactions open in this environment now, in any process (LMDB's reader table; slots
        of idle threads hold none). Nonzero at rest means a leaked transaction. Any thread."""
        try:
            rows = self._opened.env.readers().splitlines()[1:]  # after the "pid thread txnid" header
        except lmdb.Error:  # the environment is being reopened after corruption: no transactions in it
            return 0
        return sum(1 for row in rows if row.split()[-1] != "-")

    def disk_stats(self) -> DiskStats:
        data = self.path / "data.mdb"
        num, used, pending = self.index.sizes()
        with self.index.lock:
            c = _Counts(**{f: getattr(self._counts, f) for f in _Counts.__dataclass_fields__})
        return DiskStats(
            str(self.path), num, self.capacity_blocks, self.spec.block_bytes, used, self._map_bytes,
            data.stat().st_size if data.exists() else 0, pending, c.corrupt, c.dropped, c.evicted, c.map_full,
            tuple(c.moved_aside), c.write_errors,
        )

    # --------------------------------------------------------------- mutations
    def digest_of(self, key: BlockKey) -> int | None:
        """The digest of ``key``'s block when known: given to `put`, or read from its record by `get_into`."""
        entry = self.index.get(key)
        return entry.digest if entry is not None else None

    def put(self, key: BlockKey, src: Block, *, digest: int | None = None) -> bool:
        """Queue ``src`` (``spec.block_shape``, any device) for writing under ``key``. ``digest``: the
        block's digest, which an ``xxh3`` record stores as its checksum (see `kvstore.block_record`).

        The block is readable at once. Returns False (nothing queued, counted as dropped) when the
        write queue is full or the block cannot fit; True otherwise (also when the key is already held,
        which only refreshes it).
        """
        self._reset_if_needed()
        if self.unavailable_reason is not None:
            self._count("dropped")
            return False
        if self.touch(key):
            return True
        record = self._codec.new_record(key)
        copy_block(np.frombuffer(record, dtype=np.uint8, count=self.spec.block_bytes, offset=HEADER_BYTES), src)
        entry = Entry(self._record_disk_bytes, 0, record, digest)
        victims = None
        if self._writer.pending_put_bytes + entry.disk_bytes <= self.options.max_pending_bytes:
            victims = self.index.add(key, entry, high_bytes=self._high_bytes, low_bytes=self._low_bytes)
        if victims is None:
            self._count("dropped")
            return False
        self._count("evicted", len(victims))
        for victim in victims:
            self._writer.submit(Delete(victim))
        self._writer.submit(Put(key, entry))
        return True

    def touch(self, key: BlockKey) -> bool:
        return self.index.touch(key) is not None

    def discard(self, key: BlockKey) -> bool:
        if self.index.discard(key) is None or self.unavailable_reason is not None:
            return False
        self._writer.submit(Delete(key))
        return True

    def get_into(self, key: BlockKey, dst: Block) -> bool:
        """Copy the block under ``key`` into the contiguous tensor ``dst`` (any device).

        True only if the record's header matches this spec and key and its checksum holds. A bad record
        is deleted and counted (`kvrelay_store_corrupt_total`, and ``on_corrupt(key, problem)`` when set);
        an I/O error keeps the entry. Either is a miss (False) and ``dst`` may hold anything. A read
        ``xxh3`` record makes its digest known (`digest_of`).
        """
        self._reset_if_needed()
        entry = self.index.touch(key)
        if entry is None:
            return False
        record = entry.record
        if record is not None:  # still queued: in memory, checked against the digest it was put with
            landing = self._landing(dst)
            np.copyto(landing, np.frombuffer(self._codec.payload_view(record), dtype=np.uint8))
            if entry.digest is not None and block_digest(key, landing) != entry.digest:
                self._on_bad_record(key, "queued block does not match the digest it was put with")
                return False
            self._finish_copy(dst, landing)
            return True
        try:
            return self._read_committed(key, dst, entry)
        except CORRUPTION_ERRORS as exc:
            self._on_bad_record(key, f"LMDB reports corruption: {exc}")
            self._reset_reason = f"LMDB reported corruption: {exc}"
            self._needs_reset.set()
            return False
        except (OSError, lmdb.Error) as exc:
            log.warning("disk tier %s: I/O error reading block %s (%s); treated as a miss, entry kept",
                        self.path, key.hex()[:16], exc)
            return False

    def _read_committed(self, key: BlockKey, dst: Block, entry: Entry) -> bool:
        o = self._opened
        header = bytearray(HEADER_BYTES)
        landing = self._landing(dst)
        with self._read_txn() as txn:
            value = txn.get(key, db=o.blocks)
            if value is None:
                self.index.discard(key)
                return False
            problem = (
                f"value of {len(value)} bytes, need {HEADER_BYTES + self.spec.block_bytes}"
                if len(value) < HEADER_BYTES + self.spec.block_bytes else None
            )
            if problem is None:
                read_value(value, header, landing)
                # Check the copy, not the stored value: the copy is in the CPU cache.
                problem = self._codec.header_problem(key, memoryview(header), len(value)) or (
                    self._codec.checksum_problem(memoryview(header), memoryview(landing))
                )
            if problem is not None:
                self._on_bad_record(key, problem)
                return False
        entry.digest = self._codec.record_digest(header)
        self._finish_copy(dst, landing)
        return True

    def _landing(self, dst: Block) -> np.ndarray:
        """Where a read lands on the CPU: ``dst``'s own bytes, or the pinned staging buffer for a GPU ``dst``."""
        if isinstance(dst, np.ndarray):
            return dst
        if dst.device.type == "cpu":
            return dst.view(-1).view(torch.uint8).numpy()
        assert self._staging is not None
        return self._staging.numpy()

    def _finish_copy(self, dst: Block, landing: np.ndarray) -> None:
        if landing is not dst and not isinstance(dst, np.ndarray) and dst.device.type != "cpu":
            dst.view(-1).view(torch.uint8).copy_(self._staging)

    def _on_bad_record(self, key: BlockKey, problem: str) -> None:
        log.warning("disk tier %s: block %s is corrupt (%s); deleted", self.path, key.hex()[:16], problem)
        self._count("corrupt")
        self.discard(key)
        if self.on_corrupt is not None:
            self.on_corrupt(key, problem)

    def add_counters(self, deltas: Mapping[str, int]) -> None:
        """Add to the lifetime counters persisted in the ``meta`` sub-database (with the next batch)."""
        self.index.add_counters(deltas)

    @contextlib.contextmanager
    def _read_txn(self) -> Iterator[lmdb.Transaction]:
        """A read transaction (zero-copy buffers); a reader table full of dead processes is cleared once.

        Holds ``_map_lock``: `grow_map` remaps the environment, which must not happen under a reader."""
        with self._map_lock:
            env = self._opened.env
            try:
                txn = env.begin(buffers=True)
            except lmdb.ReadersFullError:
                self.clear_stale_readers()
                txn = env.begin(buffers=True)
            with txn:
                yield txn

    @property
    def map_lock(self) -> threading.Lock:
        """Held by every read transaction of this process; the writer takes it to remap or to commit
        with no snapshot pinned."""
        return self._map_lock

    def grow_map_locked(self) -> bool:
        """Writer thread, holding `map_lock`, after MDB_MAP_FULL left no page even to delete: enlarge the
        map by ~2% (at most ``MAP_SLACK_FRAC`` past the configured size in all). False when used up."""
        limit = int(self._configured_map_bytes * (1 + MAP_SLACK_FRAC))
        if self._map_bytes >= limit:
            return False
        page = self._opened.page_bytes
        new = min(limit, self._map_bytes + max(64 * page, self._map_bytes // 50) // page * page)
        self._opened.env.set_mapsize(new)
        self._map_bytes = new
        enable_readahead(self.path / "data.mdb")  # LMDB remapped
        log.warning("disk tier %s: LMDB map grown to %d bytes to make room for evictions", self.path, new)
        return True

    def clear_stale_readers(self) -> int:
        """Free reader slots of dead processes (``mdb_reader_check``). Returns how many."""
        return self._opened.env.reader_check()

    # ------------------------------------------------------------ housekeeping
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued write is committed (or dropped).

        Raises:
            TimeoutError: the writer did not finish within ``timeout_s``.
        """
        self._reset_if_needed()
        if self.unavailable_reason is None:
            self._writer.flush(timeout_s)

    def _reset_if_needed(self) -> None:
        """Caller thread: move the environment aside and start a fresh one, when the writer or a read asked
        for it. A fresh start that fails (the disk is full, gone read-only) puts the tier out of use."""
        if not self._needs_reset.is_set() or self.unavailable_reason is not None:
            return
        self._needs_reset.clear()
        self._writer.stop(timeout_s=30.0)
        self._opened.env.close()
        try:
            moved = str(move_aside(self.path, self._reset_reason))
            with self.index.lock:
                self._counts.moved_aside.append(moved)
            self._start()
        except (OSError, lmdb.Error) as exc:
            self.unavailable_reason = str(self._unavailable(exc))
            self.index.load({}, default_disk_bytes=self._record_disk_bytes)  # nothing is readable any more
            self.metrics.disk_available.set(0)
            self.metrics.disk_open_failures.labels(errno_name(exc)).inc()
            log.error("%s; serving without the disk tier", self.unavailable_reason)

    def request_reset(self, reason: str, *, corrupt: bool) -> None:
        """Writer thread: the environment is corrupt (counted) or wedged; the caller thread moves it aside
        and starts a fresh one at its next call."""
        if corrupt:
            self._count("corrupt")
        self._reset_reason = reason
        self._needs_reset.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Commit queued writes, stop the writer and close the environment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.stop(timeout_s=60.0)
        finally:
            self._opened.env.close()  # idempotent (closed already when a fresh start failed)
            self._owner.release()

    def note_dropped(self, n: int) -> None:
        """Writer thread: ``n`` queued writes could not be committed."""
        self._count("dropped", n)

    def note_write_error(self) -> None:
        """Writer thread: a commit failed with an I/O error (disk full, EIO)."""
        self._count("write_errors")

    def note_map_full(self, num_evicted: int) -> None:
        """Writer thread: MDB_MAP_FULL happened and ``num_evicted`` blocks were evicted for room."""
        self._count("map_full")
        self._count("evicted", num_evicted)

    # --------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Flush, then assert the index matches the ``blocks`` and ``atime`` sub-databases exactly.

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        self.flush()
        if self.unavailable_reason is not None:
            assert self.index.sizes()[0] == 0, "an unavailable disk tier still indexes blocks"
            return
        o = self._opened
        with self._read_txn() as txn:
            on_disk = {bytes(k): len(v) for k, v in txn.cursor(db=o.blocks).iternext()}
            timed = {bytes(k) for k in txn.cursor(db=o.atime).iternext(values=False)}
        index, used = self.index.snapshot()
        assert set(index) == set(on_disk), (
            f"disk index and LMDB differ: {len(set(index) - set(on_disk))} only indexed, "
            f"{len(set(on_disk) - set(index))} only stored"
        )
        assert timed == set(on_disk), "atime and blocks sub-databases hold different keys"
        assert all(e.record is None for e in index.values()), "a record is still pending after flush"
        assert used == sum(e.disk_bytes for e in index.values()), "disk used bytes do not add up"
        for k, value_len in on_disk.items():
            assert index[k].disk_bytes == entry_bytes(value_len, o.page_bytes), f"size of {k.hex()[:16]}"

    def verify(self, *, delete: bool = True, on_bad: Callable[[BlockKey, str], None] | None = None) -> VerifyReport:
        """Flush, then check the header and checksum (`RecordCodec.problem`) of every committed record.

        Records are read in key order, in read transactions of about ``VERIFY_TXN_BYTES`` of values
        each, so no snapshot stays pinned (and `map_lock` held) for the whole pass. Each bad record is
        logged and given to ``on_bad(key, problem)``; with ``delete`` it is also deleted and counted as
        a bad read's is (``kvrelay_store_corrupt_total``, ``disk.corrupt``), without ``on_corrupt``, which
        is told of bad reads. ``delete=False`` changes and counts nothing. A record re-put meanwhile
        (queued again, so indexed as pending) is left to its new write.

        Raises:
            TimeoutError: the flush did not finish (see `flush`); nothing was checked.
            one of CORRUPTION_ERRORS: LMDB reports the environment corrupt; as after such a read, the
                tier moves it aside at its next call. Records deleted before stay deleted.
            lmdb.Error / OSError: an I/O error; nothing more is checked or deleted.
        """
        start = time.monotonic()
        self.flush()
        progress = _VerifyPass()
        num_deleted = 0
        more = True
        while more:
            num_bad_before = len(progress.bad)
            try:
                more = self._verify_some(progress)
            except CORRUPTION_ERRORS as exc:
                self._reset_reason = f"LMDB reported corruption: {exc}"
                self._needs_reset.set()
                raise
            for bad in progress.bad[num_bad_before:]:  # deleted outside the read transaction, by the writer
                deleted = delete and self._discard_committed(bad.key)
                log.warning("disk tier %s: block %s is corrupt (%s)%s", self.path, bad.key.hex()[:16], bad.problem,
                            "; deleted" if deleted else "")
                if deleted:
                    num_deleted += 1
                    self._count("corrupt")
                if on_bad is not None:
                    on_bad(bad.key, bad.problem)
        return VerifyReport(progress.num_checked, progress.checked_bytes, tuple(progress.bad), num_deleted,
                            time.monotonic() - start)

    def _verify_some(self, progress: _VerifyPass) -> bool:
        """Check records past ``progress.after`` in one read transaction until ``VERIFY_TXN_BYTES`` of
        values are checked; adds to ``progress``. True while records remain."""
        with self._read_txn() as txn:
            cursor = txn.cursor(db=self._opened.blocks)
            found = cursor.first() if progress.after is None else cursor.set_range(progress.after)
            if found and progress.after is not None and bytes(cursor.key()) == progress.after:
                found = cursor.next()
            checked_bytes = 0
            while found:
                if checked_bytes >= VERIFY_TXN_BYTES:
                    return True
                key, value = BlockKey(bytes(cursor.key())), cursor.value()
                problem = self._codec.problem(key, value)
                if problem is not None:
                    progress.bad.append(BadRecord(key, problem))
                checked_bytes += len(value)
                progress.num_checked += 1
                progress.checked_bytes += len(value)
                progress.after = key
                found = cursor.next()
        return False

    def _discard_committed(self, key: BlockKey) -> bool:
        """Delete ``key`` if its indexed entry is the committed record (not one queued again since)."""
        entry = self.index.get(key)
        return entry is not None and entry.record is None and self.discard(key)

    def read_counters(self) -> dict[str, int]:
        """Lifetime counters from the ``meta`` sub-database (committed ones)."""
        o = self._opened
        with self._read_txn() as txn:
            return {
                bytes(k).decode()[6:]: read_u64(v)
                for k, v in txn.cursor(db=o.meta).iternext() if bytes(k).startswith(b"count.")
            }

