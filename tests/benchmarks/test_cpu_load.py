"""`benchmarks.cpu_load`: busy CPUs from two ``/proc/stat`` readings."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvrelay.benchmarks.cpu_load import CpuTicks, busy_cpus, measure_busy_cpus, parse_proc_stat, wait_until_quiet

STAT = "cpu  100 5 50 1000 20 3 2 10 7 0\ncpu0 50 5 25 500 10 2 1 5 7 0\nintr 12345\n"


def test_busy_and_total_ticks_from_the_all_cpu_line() -> None:
    # busy = user 100 + nice 5 + system 50 + irq 3 + softirq 2 + steal 10; guest (7) is inside user already
    assert parse_proc_stat(STAT) == CpuTicks(busy=170, total=1190)
    with pytest.raises(ValueError, match="no 'cpu' line of 8 or more fields"):
        parse_proc_stat("cpu0 1 2 3\n")


def test_busy_cpus_between_two_readings() -> None:
    before, after = CpuTicks(busy=170, total=1190), CpuTicks(busy=270, total=1390)
    assert busy_cpus(before, after, num_cpus=2) == 1.0  # half of all ticks busy, on 2 CPUs
    assert busy_cpus(before, CpuTicks(busy=170, total=1390), num_cpus=2) == 0.0
    assert busy_cpus(before, before, num_cpus=2) == 0.0


def test_no_proc_stat_is_not_measured(tmp_path: Path) -> None:
    assert measure_busy_cpus(0.0, proc_stat=tmp_path / "nope") is None
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert measure_busy_cpus(0.0, proc_stat=stat) == 0.0  # the same text twice: no tick passed


def test_waiting_for_quiet_returns_at_the_first_quiet_sample(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert wait_until_quiet(0.3, timeout_s=60.0, sample_s=0.0, proc_stat=stat).busy_cpus == 0.0
    gone = wait_until_quiet(0.3, timeout_s=60.0, sample_s=0.0, proc_stat=tmp_path / "nope")
    assert gone.busy_cpus is None
