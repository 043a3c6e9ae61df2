"""Thread budget: which CPUs each node of one machine may use, so that nodes never oversubscribe it.

`kvrelay up` splits the CPUs it may use (its affinity mask) among the engine nodes it starts,
disjoint and as even as the count allows; each node pins itself to its share and runs torch with one
intra-op thread per CPU of it (one inter-op thread: a step is one chain of ops). A node started on
its own (``kvrelay prefill|decode``, e.g. in a Kubernetes pod) takes every CPU its mask allows.
The router needs no share: it does no math and sleeps on its event loop.
"""

from __future__ import annotations

import os
import re

import torch


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


def apply_cpus(cpus: list[int] | None) -> list[int]:
    """Pin this process to ``cpus`` (None: keep its mask) and size torch's thread pools to it.

    Call before torch runs any parallel work. Returns the CPUs now in use.

    Raises:
        OSError: a CPU is not available to this process.
    """
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    mine = available_cpus()
    torch.set_num_threads(len(mine))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran: keep what is there
        pass
    return mine
