"""The disk tier on a broken disk (issue 30, failure mode 7): full, unwritable, a truncated ``data.mdb``,
repeated resets, and ENOSPC while the writer runs. Real LMDB on real filesystems: a small tmpfs (this
test process must be allowed to mount one; the tests that need it skip, saying so, where it is not) for a
disk that fills up, a path under a regular file and a read-only tmpfs for one that cannot be written.

The scenarios that may end in a signal (LMDB maps its files: touching a page the filesystem cannot back is
SIGBUS) run in a child process, so that a regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kvrelay.kvstore.lmdb_tier import LmdbOptions, LmdbTier
from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig

from tests.kvstore.store_helpers import SPEC, block_value, chain

REPO = Path(__file__).resolve().parents[2]
KiB = 1024


def _try_mount(target: Path, options: str) -> str | None:
    """Mount a tmpfs at ``target``; None when done, else why not."""
    target.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount is not available ({exc})"
    return None if done.returncode == 0 else f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``tmpfs(size_kib, ro=False)``: a fresh tmpfs of that size, unmounted after the test."""
    mounted: list[Path] = []

    def make(size_kib: int, *, ro: bool = False, name: str = "mnt") -> Path:
        target = tmp_path / name
        why = _try_mount(target, f"size={size_kib}k,mode=0700" + (",ro" if ro else ""))
        if why is not None:
            pytest.skip(f"needs a small tmpfs to fill up: {why}")
        mounted.append(target)
        return target

    yield make
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], check=False, timeout=30)


def fill(mount: Path, *, leave_kib: int) -> Path:
    """Write a filler file that leaves about ``leave_kib`` KiB free on ``mount``; returns its path."""
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    filler = mount / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_kib * KiB))
    return filler


def run_child(code: str, timeout_s: float = 120.0) -> tuple[int, dict]:
    """Run ``code`` in a fresh interpreter (repository on ``sys.path``); it prints one JSON line last.
    Returns (exit code, negative for a signal; that JSON, or {} when it printed none)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
    return done.returncode, json.loads(lines[-1]) if lines else {}


STORE_CHILD = """
    import json, sys, torch
    from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig
    from tests.kvstore.store_helpers import SPEC, block_value, chain, write_blocks
    store = TieredStore(SPEC, TieredStoreConfig(num_device_blocks=8, num_host_blocks=8, disk_path={path!r},
                                                disk_capacity_bytes=64 << 20))
    keys = chain(6)
    store.block_pool.release(write_blocks(store, keys, [block_value(i) for i in range(6)]))
    store.block_pool.allocate(8)  # every device block: the six cached ones go to host
    match = store.match_prefix(keys)
    status = store.disk_status
    reg = store.metrics.registry
    print(json.dumps({{"state": status.state, "reason": status.reason, "disk": store.disk is not None,
                      "tiers": list(match.tiers),
                      "failures": reg.get_sample_value("kvrelay_store_disk_open_failures_total",
                                                       {{"reason": {errno_name!r}}}),
                      "available": reg.get_sample_value("kvrelay_store_disk_available")}}))
"""


def test_a_store_on_a_full_disk_starts_without_its_disk_tier_and_serves(tmpfs):
    mount = tmpfs(256)
    fill(mount, leave_kib=0)
    code, out = run_child(STORE_CHILD.format(path=str(mount / "kv"), errno_name="ENOSPC"))
    assert code == 0, f"child exited with {code} ({signal.Signals(-code).name if code < 0 else 'error'})"
    assert out["state"] == "unavailable" and not out["disk"]
    assert "No space left on device" in out["reason"] and str(mount / "kv") in out["reason"]
    assert out["failures"] == 1.0 and out["available"] == 0.0
    assert out["tiers"] == ["host"] * 6


@pytest.mark.parametrize("how", ["under_a_file", "read_only_mount"])
def test_a_store_on_an_unwritable_path_starts_without_its_disk_tier(tmp_path, tmpfs, how):
    if how == "under_a_file":
        (tmp_path / "file").write_text("not a directory")
        path, errno_name, words = tmp_path / "file" / "disk" / "kv", "ENOTDIR", "Not a directory"
    else:
        path, errno_name, words = tmpfs(256, ro=True) / "kv", "EROFS", "Read-only file system"
    code, out = run_child(STORE_CHILD.format(path=str(path), errno_name=errno_name))
    assert code == 0
    assert out["state"] == "unavailable" and not out["disk"] and words in out["reason"]
    assert out["failures"] == 1.0 and out["available"] == 0.0
    assert out["tiers"] == ["host"] * 6


def test_a_store_with_a_disk_tier_says_so(tmp_path):
    store = TieredStore(SPEC, TieredStoreConfig(num_device_blocks=4, disk_path=str(tmp_path / "kv"),
                                                disk_capacity_bytes=1 << 20))
    try:
        status = store.disk_status
        assert (status.state, status.reason, status.path) == ("open", None, str(tmp_path / "kv"))
        assert store.metrics.registry.get_sample_value("kvrelay_store_disk_available") == 1.0
    finally:
        store.close()
    none = TieredStore(SPEC, TieredStoreConfig(num_device_blocks=4)).disk_status
    assert (none.state, none.reason, none.path) == ("none", None, None)


@pytest.mark.parametrize("keep_bytes", [8 * KiB, 20 * KiB, 6000])
def test_a_truncated_data_mdb_is_moved_aside_at_open_without_a_signal(tmp_path, keep_bytes):
    path = tmp_path / "kv"
    tier = LmdbTier(SPEC, path, capacity_bytes=4 << 20)
    keys = chain(40)
    for i, key in enumerate(keys):
        tier.put(key, block_value(i))
    tier.close()
    assert (path / "data.mdb").stat().st_size > 40 * 4 * KiB
    os.truncate(path / "data.mdb", keep_bytes)
    code, out = run_child(f"""
        import json, torch
        from kvrelay.kvstore.lmdb_tier import LmdbTier
        from tests.kvstore.store_helpers import SPEC, block_value, chain
        tier = LmdbTier(SPEC, {str(path)!r}, capacity_bytes=4 << 20)
        keys = chain(40)
        found = tier.match_prefix(keys)
        tier.put(keys[0], block_value(0))
        tier.flush()
        dst = torch.empty(SPEC.block_shape)
        ok = tier.get_into(keys[0], dst) and torch.equal(dst, block_value(0))
        stats = tier.disk_stats()
        tier.check_integrity()
        tier.close()
        print(json.dumps({{"found": found, "read_back": ok, "moved": list(stats.moved_aside),
                          "corrupt": stats.num_corrupt}}))
    """)
    assert code == 0, f"child exited with {code} ({signal.Signals(-code).name if code < 0 else 'error'})"
    assert out["found"] == 0 and out["read_back"] and out["corrupt"] == 1
    [moved] = out["moved"]
    assert Path(moved).name.startswith("kv.corrupt-") and (Path(moved) / "data.mdb").stat().st_size == keep_bytes


def test_resets_keep_at_most_one_old_copy(tmp_path):
    path = tmp_path / "kv"
    moved: list[str] = []
    garbage: list[bytes] = []
    for round_ in range(4):
        tier = LmdbTier(SPEC, path, capacity_bytes=1 << 20)
        moved += tier.disk_stats().moved_aside
        tier.put(chain(1, first_token=round_)[0], block_value(round_))
        tier.close()
        if round_ < 3:
            garbage.append(os.urandom(3 * 4 * KiB))
            with open(path / "data.mdb", "r+b") as f:
                f.write(garbage[-1])
    assert len(moved) == 3  # each of the last three opens moved a damaged environment aside
    [kept] = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert str(kept) == moved[-1]
    assert (kept / "data.mdb").read_bytes()[: len(garbage[-1])] == garbage[-1]  # the newest copy


def test_enospc_in_the_writer_backs_off_drops_and_recovers(tmpfs, caplog):
    """A full disk under a running writer: every failed commit is counted and the next one waits twice as
    long (bounded), the writes meanwhile are dropped and counted, reads keep working, and once there is
    room again new blocks are committed."""
    mount = tmpfs(1024)
    filler = fill(mount, leave_kib=160)
    options = LmdbOptions(write_backoff_min_s=0.05, write_backoff_max_s=0.4)
    tier = LmdbTier(SPEC, mount / "kv", capacity_bytes=64 << 20, options=options)  # map far above the tmpfs
    try:
        keys = chain(400)
        with caplog.at_level(logging.ERROR, logger="kvrelay.kvstore.lmdb_writer"):
            start = time.monotonic()
            for i, key in enumerate(keys[:300]):
                tier.put(key, block_value(i))
                time.sleep(0.005)
                tier.flush()
            elapsed_s = time.monotonic() - start
        stats = tier.disk_stats()
        failed = [r for r in caplog.records if "write failed" in r.getMessage()]
        assert stats.num_write_errors == len(failed) >= 1
        # Back-off: 0.05, 0.1, 0.2, then 0.4 s between attempts; no attempt in between.
        assert len(failed) <= 4 + elapsed_s / 0.4, (len(failed), elapsed_s)
        assert stats.num_dropped > len(failed)  # writes during a back-off are dropped without an attempt
        assert tier.metrics.registry.get_sample_value("kvrelay_store_disk_write_errors_total") == len(failed)
        committed = tier.keys_lru_first()
        assert len(committed) + stats.num_dropped == 300 and committed
        dst = torch.empty(SPEC.block_shape)
        assert tier.get_into(committed[0], dst) and torch.equal(dst, block_value(keys.index(committed[0])))

        filler.unlink()  # room again: writes resume after the current back-off
        deadline = time.monotonic() + 30
        while True:
            tier.put(keys[300], block_value(300))
            tier.flush()
            if keys[300] in tier.keys_lru_first() and tier.index.get(keys[300]).record is None:
                break
            assert time.monotonic() < deadline, "writes did not resume once the disk had room"
            time.sleep(0.1)
        tier.check_integrity()
    finally:
        tier.close()
    reopened = LmdbTier(SPEC, mount / "kv", capacity_bytes=64 << 20)
    try:
        assert keys[300] in reopened.keys_lru_first()
        assert reopened.disk_stats().moved_aside == ()  # a full disk is not corruption: nothing moved aside
    finally:
        reopened.close()


def test_a_failed_reset_leaves_the_store_serving_without_its_disk_tier(tmpfs):
    """The disk tier starts afresh after LMDB reported corruption; when that fresh start fails (here: the
    disk is full), the store carries on without the tier instead of failing its caller (the engine)."""
    mount = tmpfs(512)
    code, out = run_child(f"""
        import json, os
        from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig
        from tests.kvstore.store_helpers import SPEC, block_value, chain, write_blocks
        from tests.kvstore.test_disk_faults import fill
        from pathlib import Path
        store = TieredStore(SPEC, TieredStoreConfig(num_device_blocks=4, num_host_blocks=4,
                            disk_path={str(mount / "kv")!r}, disk_capacity_bytes=64 << 20))
        before = store.disk_status.state
        keys = chain(3)
        store.block_pool.release(write_blocks(store, keys, [block_value(i) for i in range(3)]))
        fill(Path({str(mount)!r}), leave_kib=0)
        store.disk.request_reset("test: LMDB reported corruption", corrupt=True)
        store.flush()  # the tier resets at its next call
        status = store.disk_status
        store.block_pool.allocate(4)  # the three cached blocks go to host
        tiers = store.match_prefix(keys).tiers
        written = store.persist()
        store.close()
        print(json.dumps({{"before": before, "state": status.state, "reason": status.reason, "tiers": list(tiers),
                          "written": written}}))
    """)
    assert code == 0, f"child exited with {code} ({signal.Signals(-code).name if code < 0 else 'error'})"
    assert out["before"] == "open" and out["state"] == "unavailable"
    assert "No space left on device" in out["reason"]
    assert out["tiers"] == ["host"] * 3 and out["written"] == 0
