"""The thread budget: disjoint CPU shares per node, and what a node does with its share."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from kvrelay.deploy.cpu_budget import CoreLending, parse_cpus, split_cpus


@pytest.mark.parametrize(("cpus", "nodes", "want"), [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1], 1, [[0, 1]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([2, 5, 7], 3, [[2], [5], [7]]),
    ([0, 1], 4, [[0], [1], [0], [1]]),  # more nodes than CPUs: shared round-robin
])
def test_split_is_disjoint_and_even(cpus: list[int], nodes: int, want: list[list[int]]) -> None:
    assert split_cpus(cpus, nodes) == want


def test_split_needs_cpus_and_nodes() -> None:
    with pytest.raises(ValueError, match="cannot split 0 CPUs among 1 nodes"):
        split_cpus([], 1)


def test_parse_cpus() -> None:
    assert parse_cpus("0,2-3") == [0, 2, 3] and parse_cpus("1") == [1]
    for bad in ("", "a", "1-", "-1", "0,,1"):
        with pytest.raises(ValueError, match="use CPU numbers and ranges, e.g. 0,2-3"):
            parse_cpus(bad)


def test_a_node_pins_itself_and_sizes_torch_threads_to_its_share() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = ("import os, torch; from kvrelay.deploy.cpu_budget import apply_cpus; "
            f"got = apply_cpus([{cpu}]); print(got, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), "
            "torch.get_num_interop_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("]")
    assert out[0] == f"[{cpu}" and out[1].strip() == f"[{cpu}" and out[2].split() == ["1", "1"]


# ------------------------------------------------------------------------------- core lending
def _lending(tmp_path, home: list[int], pool: list[int], log: list[int]) -> CoreLending:
    # Two instances in one process conflict exactly as two processes do: flock locks belong to open files.
    return CoreLending(str(tmp_path), home, pool, set_threads=log.append)


def test_an_idle_nodes_cpus_are_borrowed_and_an_owner_with_work_keeps_its_own(tmp_path) -> None:
    sets_a: list[int] = []
    sets_b: list[int] = []
    a = _lending(tmp_path, [0], [0, 1], sets_a)
    b = _lending(tmp_path, [1], [0, 1], sets_b)
    assert a.before_step() == 2 and a.threads == 2 and sets_a == [2]  # b idle: a borrows CPU 1
    a.after_step()
    assert b.before_step() == 1 and sets_b == []  # a still has work: b runs on its own CPU only
    assert a.before_step() == 1 and sets_a == [2, 1]  # b wants CPU 1 now: a no longer borrows it
    a.after_step()
    a.idle()  # a has nothing left: b borrows CPU 0 from its next step on
    assert a.threads == 1 and sets_a == [2, 1]  # (already back to its own CPU count: nothing set)
    b.after_step()
    assert b.before_step() == 2 and sets_b == [2]
    b.after_step()
    b.idle()
    assert b.threads == 1 and sets_b == [2, 1]  # idle: back to its own CPUs
    a.close()
    b.close()


def test_an_owner_waits_for_the_borrowers_step_then_gets_its_cpu_back(tmp_path) -> None:
    a = _lending(tmp_path, [0], [0, 1], [])
    b = _lending(tmp_path, [1], [0, 1], [])
    assert a.before_step() == 2  # a computes on CPU 1 too
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(b.before_step()))
    t.start()
    t.join(0.3)
    assert t.is_alive() and got == []  # b has work but waits for the end of a's step
    a.after_step()
    t.join(5)
    assert got == [1]
    assert a.before_step() == 1  # and a's next step stays on its own CPU
    a.close()
    b.close()


def test_a_node_that_dies_mid_step_frees_its_own_and_its_borrowed_cpus(tmp_path) -> None:
    code = ("import sys, time; from kvrelay.deploy.cpu_budget import CoreLending; "
            f"c = CoreLending({str(tmp_path)!r}, [1], [0, 1], set_threads=lambda n: None); "
            "print(c.before_step(), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    a = _lending(tmp_path, [0], [0, 1], [])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "2"  # it borrowed CPU 0 too
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(a.before_step()))
        t.start()
        t.join(0.3)
        assert t.is_alive() and got == []  # a waits for its CPU 0
        proc.kill()
        proc.wait(10)
        t.join(5)
        assert got == [2]  # the dead node's locks went with it: a has CPU 0 and borrows CPU 1
    finally:
        proc.kill()
        proc.wait(10)
        a.close()


def test_borrowed_cpu_seconds_count_borrowed_cpus_times_step_time(tmp_path, monkeypatch) -> None:
    clock = iter([10.0, 10.5, 20.0, 20.25])  # two steps: 0.5 s, then 0.25 s
    monkeypatch.setattr("kvrelay.deploy.cpu_budget.time.monotonic", lambda: next(clock))
    a = CoreLending(str(tmp_path), [0], [0, 1, 2], set_threads=lambda n: None)
    b = CoreLending(str(tmp_path), [1], [0, 1, 2], set_threads=lambda n: None)
    assert a.before_step() == 3  # b and CPU 2's owner idle: a borrows CPUs 1 and 2
    a.after_step()
    assert a.borrowed_cpu_s == 1.0  # 2 CPUs x 0.5 s
    assert b.before_step() == 2  # a keeps its own CPU between steps; CPU 2 (no owner running) is b's to borrow
    b.after_step()
    assert b.borrowed_cpu_s == 0.25  # 1 CPU x 0.25 s
    assert a.borrowed_cpu_s == 1.0
    a.close()
    b.close()


def test_lending_refuses_a_home_outside_the_pool(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"home CPUs \[2\] must be a non-empty part of the pool \[0, 1\]"):
        CoreLending(str(tmp_path), [2], [0, 1])
    with pytest.raises(ValueError, match="must be a non-empty part"):
        CoreLending(str(tmp_path), [], [0, 1])


def test_kvrelay_processes_back_large_tensors_with_huge_pages() -> None:
    code = ("import os, sys, deploy.cli; assert 'torch' not in sys.modules, 'torch came first'; import torch; "
            "x = torch.empty(8 << 20, dtype=torch.uint8); x.fill_(1); "
            "print(os.environ['THP_MEM_ALLOC_ENABLE'], "
            "[int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')][0])")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    flag, huge_kb = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   env=env).stdout.split()
    assert flag == "1"
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" not in mode:  # the kernel grants them (this machine: "madvise")
        assert int(huge_kb) >= 2048


def test_up_hands_each_node_its_share_the_pool_and_the_lock_dir() -> None:
    from pathlib import Path

    from kvrelay.deploy.up import _role_cmd

    cmd = _role_cmd("decode", Path("c.yaml"), 0, [], [1], ([0, 1], "/tmp/locks"))
    assert cmd[-6:] == ["--cpus", "1", "--cpu-pool", "0,1", "--cpu-lock-dir", "/tmp/locks"]
    assert _role_cmd("decode", Path("c.yaml"), 0, [], [1])[-2:] == ["--cpus", "1"]  # --no-cpu-lending


@pytest.mark.parametrize(("args", "message"), [
    (["--cpus", "0", "--cpu-pool", "0-1"], "--cpu-pool and --cpu-lock-dir go together, with --cpus"),
    (["--cpu-pool", "0-1", "--cpu-lock-dir", "/tmp/x"], "--cpu-pool and --cpu-lock-dir go together, with --cpus"),
    (["--cpus", "2", "--cpu-pool", "0-1", "--cpu-lock-dir", "/tmp/x"], "--cpus 2 is not inside --cpu-pool 0-1"),
])
def test_a_node_refuses_an_inconsistent_cpu_pool(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", "decode", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and f"kvrelay decode: {message}" in proc.stderr
