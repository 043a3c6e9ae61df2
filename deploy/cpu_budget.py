"""Thread budget: which CPUs each node of one machine may use, so that nodes never oversubscribe it.

`kvrelay up` splits the CPUs it may use (its affinity mask) among the engine nodes it starts,
disjoint and as even as the count allows, and runs torch with one intra-op thread per CPU a node
computes on (one inter-op thread: a step is one chain of ops). With `CoreLending` (the default of
`kvrelay up`) a node may run on every CPU of the deployment but computes, step by step, on its own
share plus the shares of nodes that have nothing to compute; without it (``--no-cpu-lending``) each
node is pinned to its share. A node started on its own (``kvrelay prefill|decode``, e.g. in a
Kubernetes pod) takes every CPU its mask allows. The router needs no share: it does no math and
sleeps on its event loop.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Callable


def available_cpus() -> list[int]:
    """The CPUs this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


def split_cpus(cpus: list[int], num_nodes: int) -> list[list[int]]:
    """``num_nodes`` disjoint, contiguous shares of ``cpus`` (sizes differ by at most one, earlier
    nodes larger). With fewer CPUs than nodes, nodes share them round-robin (oversubscribed: the
    caller should warn).

    Raises:
        ValueError: no CPUs or no nodes.
    """
    if not cpus or num_nodes < 1:
        raise ValueError(f"cannot split {len(cpus)} CPUs among {num_nodes} nodes")
    if len(cpus) < num_nodes:
        return [[cpus[i % len(cpus)]] for i in range(num_nodes)]
    base, extra = divmod(len(cpus), num_nodes)
    shares, start = [], 0
    for i in range(num_nodes):
        size = base + (1 if i < extra else 0)
        shares.append(cpus[start : start + size])
        start += size
    return shares


def parse_cpus(text: str) -> list[int]:
    """``"0,2-3"`` → ``[0, 2, 3]``.

    Raises:
        ValueError: not a comma-separated list of CPU numbers and ranges.
    """
    out: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if match is None:
            raise ValueError(f"--cpus {text!r}: use CPU numbers and ranges, e.g. 0,2-3")
        lo = int(match[1])
        out.update(range(lo, int(match[2] or lo) + 1))
    return sorted(out)


def format_cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def apply_cpus(cpus: list[int] | None, *, threads: int | None = None) -> list[int]:
    """Pin this process to ``cpus`` (None: keep its mask) and size torch's thread pools to it
    (or to ``threads`` intra-op threads).

    Call before torch runs any parallel work. Returns the CPUs now in use.

    Raises:
        OSError: a CPU is not available to this process.
    """
    import torch  # here, not at import: the router process reads this module and loads no torch

    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    mine = available_cpus()
    torch.set_num_threads(threads or len(mine))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran: keep what is there
        pass
    return mine


class CoreLending:
    """Lend this node's CPUs to the other nodes of one machine while it has nothing to compute, and
    borrow theirs while they have nothing to compute (what `kvrelay up` sets up unless
    ``--no-cpu-lending``, or nodes would share CPUs anyway).

    A node owns its *home* CPUs (its `split_cpus` share) and may run on the whole *pool* (every CPU
    of the deployment). Per CPU ``N`` two lock files live in ``lock_dir``: ``cpu-N`` is held by
    whoever computes on N, ``want-N`` by its owner while the owner has work. Protocol, per step:

    * `before_step`: the owner takes ``want-N`` then ``cpu-N`` of each home CPU (blocking: if a
      borrower holds ``cpu-N``, the owner waits for the end of that borrower's current step, never
      longer, since a borrower re-checks ``want-N`` before each step); then it tries, without
      waiting, every other CPU whose ``want`` lock is free, and keeps those it gets for this step.
      torch's intra-op thread count is set to the CPUs held.
    * `after_step`: borrowed CPUs go back; home CPUs stay held.
    * `idle`: the engine has nothing left to do; home CPUs go back, to be lent.

    So at any moment each CPU runs one node's math (no oversubscription), and a CPU whose owner is
    idle is not left idle while another node computes. Locks are ``flock`` locks: a node that dies
    releases everything it held. Used from the engine thread only.
    """

    def __init__(self, lock_dir: str, home: list[int], pool: list[int], *,
                 set_threads: Callable[[int], None] | None = None) -> None:
        """``home`` ⊆ ``pool``, both non-empty; ``set_threads(n)`` sizes the intra-op pool (default:
        ``torch.set_num_threads``).

        Raises:
            ValueError: ``home`` empty or not inside ``pool``.
        """
        if not home or not set(home) <= set(pool):
            raise ValueError(f"home CPUs {home} must be a non-empty part of the pool {pool}")
        os.makedirs(lock_dir, exist_ok=True)
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set = set_threads

        def fd(name: str) -> int:
            return os.open(os.path.join(lock_dir, name), os.O_RDWR | os.O_CREAT, 0o600)

        self.home = sorted(home)
        self.others = [c for c in sorted(pool) if c not in home]
        self._cpu = {c: fd(f"cpu-{c}") for c in pool}
        self._want = {c: fd(f"want-{c}") for c in pool}
        self._holding_home = False
        self._borrowed: list[int] = []
        self.threads = len(self.home)
        # CPU-seconds of steps computed on borrowed CPUs (borrowed CPUs x step time), summed; read by the node's
        # metrics (kvrelay_engine_borrowed_cpu_seconds_total). Written on the engine thread only.
        self.borrowed_cpu_s = 0.0
        self._step_start_s = 0.0

    def before_step(self) -> int:
        """Hold the home CPUs and borrow what idle owners lend; returns the thread count set."""
        if not self._holding_home:
            for c in self.home:
                fcntl.flock(self._want[c], fcntl.LOCK_EX)
                fcntl.flock(self._cpu[c], fcntl.LOCK_EX)
            self._holding_home = True
        for c in self.others:
            try:
                fcntl.flock(self._want[c], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner has work
            try:
                fcntl.flock(self._cpu[c], fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._borrowed.append(c)
            except BlockingIOError:
                pass  # another borrower has it
            finally:
                fcntl.flock(self._want[c], fcntl.LOCK_UN)
        self._set_threads(len(self.home) + len(self._borrowed))
        self._step_start_s = time.monotonic()
        return self.threads

    def after_step(self) -> None:
        """Give back the CPUs borrowed for this step."""
        if self._borrowed:
            self.borrowed_cpu_s += len(self._borrowed) * (time.monotonic() - self._step_start_s)
        for c in self._borrowed:
            fcntl.flock(self._cpu[c], fcntl.LOCK_UN)
        self._borrowed = []

    def idle(self) -> None:
        """Nothing left to compute: lend the home CPUs until the next `before_step` (and size torch's
        threads back to them)."""
        self.after_step()
        if self._holding_home:
            for c in self.home:
                fcntl.flock(self._cpu[c], fcntl.LOCK_UN)
                fcntl.flock(self._want[c], fcntl.LOCK_UN)
            self._holding_home = False
        self._set_threads(len(self.home))

    def close(self) -> None:
        """Release everything and close the lock files."""
        self.idle()
        for fd in [*self._cpu.values(), *self._want.values()]:
            os.close(fd)
        self._cpu, self._want = {}, {}

    def _set_threads(self, n: int) -> None:
        if n != self.threads:
            self._set(n)
            self.threads = n
