"""The thread budget: disjoint CPU shares per node, and what a node does with its share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy.cpu_budget import parse_cpus, split_cpus


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
    code = ("import os, torch; from deploy.cpu_budget import apply_cpus; "
            f"got = apply_cpus([{cpu}]); print(got, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), "
            "torch.get_num_interop_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("]")
    assert out[0] == f"[{cpu}" and out[1].strip() == f"[{cpu}" and out[2].split() == ["1", "1"]
