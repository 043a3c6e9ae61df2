"""The disk tier across real processes: restart, a writer killed mid-transaction, killed readers."""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from kvrelay.kvstore.lmdb_env import read_snapshot
from kvrelay.kvstore.lmdb_tier import LmdbOptions

from tests.kvstore.store_helpers import SPEC, block_value, chain, write_blocks

REPO = Path(__file__).resolve().parents[2]


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The child's next stdout line, waiting at most ``timeout_s``."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"child said nothing within {timeout_s} s"
    return proc.stdout.readline().strip()


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()
    proc.stdin.close()


def test_a_second_process_serves_the_prefix_from_disk(make_store, tmp_path):
    keys = chain(4)
    store = make_store(num_device_blocks=4, disk=True)
    store.block_pool.release(write_blocks(store, keys, [block_value(i) for i in range(4)]))
    store.block_pool.release(store.block_pool.allocate(4))  # evicts all four: device → disk
    store.check_integrity()
    store.close()
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import json, torch
            from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig
            from tests.kvstore.store_helpers import SPEC, block_value, chain
            store = TieredStore(SPEC, TieredStoreConfig(
                num_device_blocks=4, disk_path={str(tmp_path / "kv")!r}, disk_capacity_bytes=1 << 20))
            keys = chain(5)
            match = store.match_prefix(keys)
            ids = store.load(keys, match)
            same = [torch.equal(store.device_pool[b], block_value(i)) for i, b in enumerate(ids)]
            reg = store.metrics.registry
            store.check_integrity()
            store.close()
            print(json.dumps({{"tiers": match.tiers, "same": same,
                              "disk_hits": reg.get_sample_value("kvrelay_prefix_cache_hits_total", {{"tier": "disk"}}),
                              "queries": reg.get_sample_value("kvrelay_prefix_cache_queries_total")}}))
        """)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.splitlines()[-1])
    assert out == {"tiers": ["disk"] * 4, "same": [True] * 4, "disk_hits": 4.0, "queries": 5.0}


def test_a_writer_killed_mid_transaction_leaves_committed_data_readable(make_disk, tmp_path):
    keys = chain(40)
    owner = make_disk(capacity_bytes=1 << 22)
    for i in range(3):
        owner.put(keys[i], block_value(i))
    owner.flush()
    # Another process writes into the same environment and dies holding LMDB's write lock.
    child = spawn(f"""
        import sys, lmdb
        env = lmdb.open({str(tmp_path / "kv")!r}, max_dbs=3, map_size=1 << 22)
        blocks = env.open_db(b"blocks")
        txn = env.begin(write=True)
        for i in range(100):
            txn.put(b"uncommitted-%03d" % i, b"x" * 5000, db=blocks)
        txn.delete({keys[0]!r}, db=blocks)
        print("mid-transaction", flush=True)
        sys.stdin.read()
    """)
    assert read_line(child, 60) == "mid-transaction"
    kill(child)
    owner.put(keys[3], block_value(3))  # the owner's writer gets the (recovered) write lock
    owner.flush(timeout_s=30)
    for i in range(4):
        dst = torch.empty(SPEC.block_shape)
        assert owner.get_into(keys[i], dst) and torch.equal(dst, block_value(i))
    owner.check_integrity()  # nothing of the killed transaction reached the environment
    owner.close()
    reopened = make_disk(capacity_bytes=1 << 22)
    assert reopened.match_prefix(keys) == 4


@contextlib.contextmanager
def reader_forker(path: Path) -> Iterator[Callable[[], str]]:
    """``reader()`` forks (from a light process) one reader of ``path``: it opens the environment, begins a
    read transaction (taking a slot in the reader table) and is SIGKILLed → "reading"; or finds the table
    full → "full". Children are reaped at once (SIGCHLD ignored), so a killed reader is dead, not a zombie."""
    zygote = spawn(f"""
        import os, signal, sys, lmdb
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        for _ in sys.stdin:
            if os.fork() == 0:
                try:
                    env = lmdb.open({str(path)!r}, max_dbs=3, readonly=True)
                    txn = env.begin()
                    os.write(1, b"%d reading\\n" % os.getpid())
                    signal.pause()
                except lmdb.ReadersFullError:
                    os.write(1, b"%d full\\n" % os.getpid())
                os._exit(0)
    """)

    def reader() -> str:
        zygote.stdin.write("go\n")
        zygote.stdin.flush()
        pid, state = read_line(zygote, 60).split()
        if state == "reading":
            os.kill(int(pid), signal.SIGKILL)
        return state

    try:
        yield reader
    finally:
        kill(zygote)


def fill_reader_table(reader: Callable[[], str]) -> None:
    for _ in range(64):
        if reader() == "full":
            return
    raise AssertionError("the reader table never filled")


def snapshot_in_new_process(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            from pathlib import Path
            from kvrelay.kvstore.lmdb_env import read_snapshot
            print(read_snapshot(Path({str(path)!r})).num_blocks)
        """)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def test_200_readers_killed_leave_no_readers_full(make_disk, tmp_path):
    path = tmp_path / "kv"
    keys = chain(1)
    owner = make_disk(options=LmdbOptions(max_readers=16, stale_reader_check_s=3600))  # no periodic clearing
    owner.put(keys[0], block_value(0))
    owner.flush()
    dst = torch.empty(SPEC.block_shape)
    killed = fulls = cleared = 0
    deadline = time.monotonic() + 120
    with reader_forker(path) as reader:
        while killed < 200:
            assert time.monotonic() < deadline, f"only {killed} readers killed in time"
            if reader() == "reading":
                killed += 1
                continue
            fulls += 1
            cleared += owner.clear_stale_readers()
        assert fulls > 0 and cleared > 0  # the dead readers really filled the table
        fill_reader_table(reader)
    # The owner's own read finds the table full of dead readers, clears it and reads.
    assert owner.get_into(keys[0], dst) and torch.equal(dst, block_value(0))
    stats = snapshot_in_new_process(path)
    assert (stats.returncode, stats.stdout.strip()) == (0, "1"), stats.stderr
    owner.close()
    assert read_snapshot(path).num_blocks == 1


def test_the_owner_clears_dead_readers_so_new_processes_can_open(make_disk, tmp_path):
    path = tmp_path / "kv"
    owner = make_disk(options=LmdbOptions(max_readers=8, stale_reader_check_s=0.1))
    owner.put(chain(1)[0], block_value(0))
    owner.flush()
    with reader_forker(path) as reader:
        fill_reader_table(reader)
    # No call into the owner: its writer thread frees the dead readers' slots on its own.
    stats = snapshot_in_new_process(path)
    assert (stats.returncode, stats.stdout.strip()) == (0, "1"), stats.stderr
