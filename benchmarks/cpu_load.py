"""How busy the machine is, from ``/proc/stat``: for a benchmark on a shared machine to say when other work ran
while it measured, instead of reporting that work's effect as kvrelay's.

``/proc/stat``'s first line counts, since boot, the clock ticks all CPUs spent in each state::

    cpu  user nice system idle iowait irq softirq steal guest guest_nice

``guest`` and ``guest_nice`` are already inside ``user`` and ``nice``. Busy = user + nice + system + irq + softirq +
steal; total = busy + idle + iowait.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuTicks:
    busy: int
    total: int


def parse_proc_stat(text: str) -> CpuTicks:
    """The all-CPU ``cpu`` line of ``/proc/stat`` text.

    Raises:
        ValueError: there is no ``cpu `` line with at least the eight fields up to ``steal``.
    """
    line = next((line for line in text.splitlines() if line.startswith("cpu ")), "")
    fields = [int(v) for v in line.split()[1:9]]
    if len(fields) < 8:
        raise ValueError(f"no 'cpu' line of 8 or more fields in /proc/stat text: {line!r}")
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return CpuTicks(busy=busy, total=busy + idle + iowait)


def busy_cpus(before: CpuTicks, after: CpuTicks, *, num_cpus: int) -> float:
    """How many of ``num_cpus`` CPUs were busy on average between two readings (0 where no tick passed)."""
    total = after.total - before.total
    return num_cpus * (after.busy - before.busy) / total if total > 0 else 0.0


def measure_busy_cpus(interval_s: float, *, proc_stat: Path = Path("/proc/stat")) -> float | None:
    """CPUs busy over the next ``interval_s`` seconds (sleeps that long); None where there is no ``/proc/stat``."""
    try:
        before = parse_proc_stat(proc_stat.read_text())
        time.sleep(interval_s)
        after = parse_proc_stat(proc_stat.read_text())
    except (OSError, ValueError):
        return None
    return busy_cpus(before, after, num_cpus=os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class QuietWait:
    busy_cpus: float | None  # the last sample's (None: not measurable here)
    waited_s: float


def wait_until_quiet(quiet_cpus: float, *, timeout_s: float, sample_s: float = 1.0,
                     proc_stat: Path = Path("/proc/stat")) -> QuietWait:
    """Sample busy CPUs every ``sample_s`` until a sample is at most ``quiet_cpus`` or ``timeout_s`` has passed
    (at least one sample); the last sample and the time spent. Servers keep a core busy for a while after their
    last request (vLLM's CPU build polls), so a benchmark that alternates servers waits for this before each run."""
    start = time.monotonic()
    while True:
        busy = measure_busy_cpus(sample_s, proc_stat=proc_stat)
        waited_s = time.monotonic() - start
        if busy is None or busy <= quiet_cpus or waited_s >= timeout_s:
            return QuietWait(busy, waited_s)
