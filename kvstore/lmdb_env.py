"""Opening the ``disk`` tier's LMDB environment: ownership, stale readers, corruption, sub-databases.

Layout on disk (``path`` is ``kvstore.disk.path``)::

    path/             mode 0700
      data.mdb        blocks, access order, metadata (three named sub-databases)
      lock.mdb        LMDB reader table
    path.owner.lock   flock held by the one process that owns the tier (it has the pid in it)
    path.corrupt-…    the environment last moved aside because it failed to open or reported corruption
                      (only the newest is kept: each move deletes the older ones)

Sub-databases: ``blocks`` (key → record, see `block_record`), ``atime`` (key → `AccessRecord`: u64
BE access sequence and u64 BE map bytes of the block, written in the writer's batches; the LRU order
survives restarts, and the index is built from it without touching any block) and ``meta`` (format,
block size, lifetime counters as u64 BE).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import lmdb

log = logging.getLogger(__name__)

FORMAT_TAG = b"kvrelay.lmdb.v1"
CORRUPTION_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(lmdb, name)
    for name in ("CorruptedError", "PageNotFoundError", "InvalidError", "VersionMismatchError", "PanicError",
                 "IncompatibleError", "BadChecksumError")
    if hasattr(lmdb, name)
)


class DiskTierInUseError(RuntimeError):
    """Another process owns the disk tier at this path."""


class DiskTierUnavailableError(RuntimeError):
    """The disk tier cannot be opened for a reason of the disk, not of its contents (full, not writable,
    I/O errors); ``reason_code`` is the errno name (`errno_name`). A corrupt environment is not this: it is
    moved aside and started afresh."""

    def __init__(self, message: str, reason_code: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


# Errno names that disk-tier failures are reported under (metric label values), most specific first.
DISK_ERRNOS = ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "ENOTDIR", "EEXIST", "ENOENT", "EIO")


def errno_name(exc: BaseException) -> str:
    """The errno name behind ``exc`` (an OSError, or an lmdb.Error whose text is the C library's) for
    `DISK_ERRNOS`, else ``"other"``. LMDB reports a write the disk cut short as EIO."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and errno.errorcode.get(code) in DISK_ERRNOS:
        return errno.errorcode[code]
    if isinstance(exc, lmdb.DiskError):
        return "ENOSPC"
    text = str(exc)
    return next((name for name in DISK_ERRNOS if os.strerror(getattr(errno, name)) in text), "other")


@dataclass(frozen=True, slots=True)
class OpenedEnv:
    """An open environment and its sub-databases."""

    env: lmdb.Environment
    blocks: lmdb._Database
    atime: lmdb._Database
    meta: lmdb._Database
    page_bytes: int


class OwnerLock:
    """An exclusive ``flock`` on ``path.owner.lock``; released by `release` or when the process dies.

    Raises:
        DiskTierInUseError: another live process holds it.
    """

    def __init__(self, path: Path) -> None:
        self.lock_path = path.with_name(path.name + ".owner.lock")
        self.lock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DiskTierInUseError(
                f"disk tier {path} is in use by another kvrelay process (pid {other}); stop it first, "
                f"or give this process its own kvstore.disk.path"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def is_owned(path: Path) -> bool:
    """Whether a live process owns the disk tier at ``path`` now."""
    try:
        OwnerLock(path).release()
    except DiskTierInUseError:
        return True
    return False


def moved_aside_copies(path: Path) -> list[Path]:
    """The environments moved aside from ``path`` that are still on disk (``path.corrupt-*``), by name."""
    return sorted(path.parent.glob(f"{path.name}.corrupt-*"))


def move_aside(path: Path, reason: str) -> Path:
    """Rename ``path`` to ``path.corrupt-<time>-<pid>[-n]``, delete the copies moved aside before (one old
    copy is kept, for a post-mortem: a disk that keeps failing must not fill up with them) and log why.
    Returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}-{os.getpid()}")
    n = 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{os.getpid()}-{n}")
    os.rename(path, target)
    deleted = [old for old in moved_aside_copies(path) if old != target]
    for old in deleted:
        shutil.rmtree(old, ignore_errors=True)
    log.warning("disk tier %s moved aside to %s (%s)%s; starting a fresh one", path, target, reason,
                f", {len(deleted)} older copies deleted" if deleted else "")
    return target


# LMDB's reader table on 64-bit Linux: a 128-byte header and one 64-byte (cache line) slot per reader.
_LOCK_HEADER_BYTES = 128
_LOCK_SLOT_BYTES = 64


def allocate_lock_file(path: Path, max_readers: int) -> None:
    """Create ``path/lock.mdb`` with its blocks allocated (``posix_fallocate``) before LMDB maps it.

    LMDB sizes the lock file with ``ftruncate`` and writes it through a shared map: on a full disk the
    first touch of an unbacked page is SIGBUS, which kills the process. Allocated here, a full disk is an
    ENOSPC OSError instead.

    Raises:
        OSError: the file cannot be created or its blocks allocated (ENOSPC, EROFS, EACCES, EIO…).
    """
    # Exactly LMDB's size: it takes a larger file's size for a larger reader table.
    want = _LOCK_HEADER_BYTES + _LOCK_SLOT_BYTES * max_readers
    fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, want)
    finally:
        os.close(fd)


def check_not_truncated(env: lmdb.Environment, path: Path) -> None:
    """Refuse an environment whose ``data.mdb`` ends before its last page: reading a page past the end of
    the mapped file is SIGBUS. Reads only the meta pages (which `lmdb.open` has checked are there).

    Raises:
        lmdb.CorruptedError: ``data.mdb`` is shorter than its meta page says.
    """
    end_bytes = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    file_bytes = (path / "data.mdb").stat().st_size
    if file_bytes < end_bytes:
        raise lmdb.CorruptedError(f"{path / 'data.mdb'} is truncated: {file_bytes} bytes, but its last page "
                                  f"ends at byte {end_bytes}")


def open_retrying(path: Path, *, timeout_s: float = 5.0, **kwargs: object) -> lmdb.Environment:
    """``lmdb.open(path, **kwargs)``, retried for up to ``timeout_s`` while the reader table is full.

    py-lmdb begins a read transaction inside ``open``, so a process cannot open an environment whose
    reader table is full of dead processes' slots, and cannot clear them (``reader_check``) before it has
    opened. The owner clears them periodically (`LmdbOptions.stale_reader_check_s`); when no process has
    the environment open, LMDB resets the table at the next open.

    Raises:
        lmdb.ReadersFullError: still full after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return lmdb.open(str(path), **kwargs)
        except lmdb.ReadersFullError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def open_env(path: Path, *, map_bytes: int, max_readers: int, block_bytes: int) -> OpenedEnv:
    """Open (creating if absent) the environment at ``path``, clear stale readers, open sub-databases,
    and record the format and ``block_bytes`` in ``meta``.

    Raises:
        one of CORRUPTION_ERRORS: the files are not a readable LMDB environment (also: ``data.mdb``
            truncated, `check_not_truncated`).
        lmdb.Error / OSError: anything else (permissions, disk full): not corruption, not handled here.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    allocate_lock_file(path, max_readers)
    # metasync=False: one fsync per commit instead of two; LMDB keeps the environment intact, and a
    # system crash can at most undo the last commit (a cache can lose it). readahead=False (MADV_RANDOM)
    # while the index is built: a cursor step touches the first page of a value, and with readahead on
    # (8 MiB on the machine this was built on) that pulled in megabytes around every value; see
    # `enable_readahead` for afterwards.
    env = open_retrying(
        path, map_size=map_bytes, subdir=True, max_dbs=3, max_readers=max_readers, mode=0o600, readahead=False,
        lock=True, metasync=False,
    )
    try:
        check_not_truncated(env, path)
        cleared = env.reader_check()
        if cleared:
            log.info("disk tier %s: cleared %d stale LMDB readers", path, cleared)
        opened = OpenedEnv(
            env=env, blocks=env.open_db(b"blocks"), atime=env.open_db(b"atime"), meta=env.open_db(b"meta"),
            page_bytes=env.stat()["psize"],
        )
        with env.begin(write=True) as txn:
            tag = txn.get(b"format", db=opened.meta)
            if tag is None:
                txn.put(b"format", FORMAT_TAG, db=opened.meta)
            elif tag != FORMAT_TAG:
                raise lmdb.VersionMismatchError(f"{path}: format {tag!r}, expected {FORMAT_TAG!r}")
            txn.put(b"block_bytes", u64(block_bytes), db=opened.meta)
    except BaseException:
        env.close()
        raise
    return opened


_MADV_NORMAL = 0
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_MAX_MMAP_THRESHOLD = 32 << 20


def keep_block_buffers_on_heap(record_bytes: int) -> bool:
    """Ask glibc to serve allocations of up to ``record_bytes`` from its heap instead of fresh ``mmap``s.

    Every put allocates a record and LMDB mallocs the value's dirty overflow pages; as fresh mmaps each of
    those is zero-filled page by page on first touch (measured: 96 puts of 2 MiB took 0.24 s, 0.03 s with
    this). Process-wide (``mallopt``): raises M_MMAP_THRESHOLD to 32 MiB and M_TRIM_THRESHOLD to 4 times
    that, so up to ~128 MiB of freed heap may stay with the process. Returns False where it does not
    apply (not glibc, or records larger than glibc's 32 MiB cap).
    """
    if record_bytes > _GLIBC_MAX_MMAP_THRESHOLD:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _GLIBC_MAX_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 4 * _GLIBC_MAX_MMAP_THRESHOLD)
    )


def enable_readahead(path: Path) -> bool:
    """``madvise(MADV_NORMAL)`` over this process's mapping of ``path`` (found in ``/proc/self/maps``).

    The environment is opened with readahead off (MADV_RANDOM) so that building the index at start
    touches only B-tree pages; reading a value through py-lmdb then faults its pages in one by one, so
    after start the map gets normal readahead back. Returns False where the mapping is not found.
    """
    target = str(path.resolve())
    try:
        with open("/proc/self/maps") as maps:
            spans = [
                [int(x, 16) for x in fields[0].split("-")]
                for fields in (line.split(maxsplit=5) for line in maps)
                if len(fields) == 6 and fields[5].strip() == target
            ]
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return bool(spans) and all(libc.madvise(start, end - start, _MADV_NORMAL) == 0 for start, end in spans)


def pack_access(seq: int, disk_bytes: int) -> bytes:
    """An ``atime`` value: the block's last access in the access sequence and its map bytes."""
    return seq.to_bytes(8, "big") + disk_bytes.to_bytes(8, "big")


def unpack_access(value: bytes | memoryview) -> tuple[int, int]:
    """``(seq, disk_bytes)`` of an ``atime`` value (disk_bytes 0 when unknown)."""
    raw = bytes(value)
    return int.from_bytes(raw[:8], "big"), int.from_bytes(raw[8:16], "big")


def read_u64(value: bytes | memoryview | None) -> int:
    return 0 if value is None else int.from_bytes(bytes(value), "big")


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class DiskSnapshot:
    """What `read_snapshot` finds in an environment (for ``kvrelay store stats``)."""

    path: str
    num_blocks: int
    used_bytes: int
    block_bytes: int
    map_bytes: int
    file_bytes: int
    counters: dict[str, int]

    @property
    def free_bytes(self) -> int:
        return max(0, self.map_bytes - self.used_bytes)


def read_snapshot(path: Path) -> DiskSnapshot | None:
    """Read-only look at the environment at ``path`` (safe while its owner runs); None if absent.

    Clears stale readers after opening; see `open_retrying` for a reader table full of dead readers.

    Raises:
        lmdb.Error: the environment cannot be read.
    """
    if not (path / "data.mdb").exists():
        return None
    env = open_retrying(path, map_size=0, readonly=True, lock=True, subdir=True, max_dbs=3, readahead=False)
    try:
        check_not_truncated(env, path)
        env.reader_check()
        meta, atime = env.open_db(b"meta", create=False), env.open_db(b"atime", create=False)
        with env.begin(buffers=True) as txn:
            num = txn.stat(atime)["entries"]  # one access record per stored block, written with it
            used = sum(unpack_access(v)[1] for v in txn.cursor(db=atime).iternext(keys=False))
            counters = {
                bytes(k).decode()[6:]: read_u64(v)
                for k, v in txn.cursor(db=meta).iternext() if bytes(k).startswith(b"count.")
            }
            block_bytes = read_u64(txn.get(b"block_bytes", db=meta))
        return DiskSnapshot(
            str(path), num, used, block_bytes, env.info()["map_size"], (path / "data.mdb").stat().st_size, counters
        )
    finally:
        env.close()


@dataclass(frozen=True, slots=True)
class LmdbOptions:
    """Tuning of the disk tier; the defaults suit blocks of tens of KiB to a few MiB.

    ``high_watermark_frac``/``low_watermark_frac`` of the usable map: a put that would pass the high
    mark evicts LRU blocks down to the low mark. The gap leaves LMDB room for pages freed by recent
    transactions, which it can reuse only two commits later. ``reserved_pages`` (meta pages,
    sub-database roots, branch pages) are kept out of the usable map. Every ``stale_reader_check_s`` the
    writer thread frees reader slots of dead processes (otherwise other processes could not even open the
    environment once the table is full of them). After a commit fails with an I/O error (a full disk:
    ENOSPC, or EIO for LMDB's short write) the writer waits ``write_backoff_min_s`` before its next
    commit, twice as long after each further failure up to ``write_backoff_max_s``, and drops (counts) the
    writes queued meanwhile.
    """

    high_watermark_frac: float = 0.90
    low_watermark_frac: float = 0.80
    max_readers: int = 126
    max_pending_bytes: int = 256 << 20
    max_batch_bytes: int = 32 << 20
    checksum: str = "pagesum"
    reserved_pages: int = 64
    stale_reader_check_s: float = 1.0
    write_backoff_min_s: float = 0.1
    write_backoff_max_s: float = 30.0
