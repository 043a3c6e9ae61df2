"""Memory free for KV at start: host memory (``/proc/meminfo`` within the cgroup's limit) and GPU memory (NVML).

A tier sized by ``fraction_of_free`` takes that share of what these report when its node starts, as vLLM's
``gpu_memory_utilization`` does for GPU memory. `kvrelay up` reads host memory once for the whole deployment and
hands each engine node its share (``--memory-budget``), so that nodes starting side by side neither race for
the same free memory nor count each other's pools.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def free_host_bytes(*, meminfo: Path = Path("/proc/meminfo"), cgroup: Path = CGROUP_ROOT) -> int:
    """Host memory this process could still take: ``MemAvailable``, or less when its cgroup's limit (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``) minus the cgroup's usage is lower (a container or pod).

    Raises:
        OSError: ``meminfo`` cannot be read or has no ``MemAvailable`` line.
    """
    available = None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
            break
    if available is None:
        raise OSError(f"{meminfo} has no MemAvailable line")
    for limit_name, usage_name in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                                      "memory/memory.usage_in_bytes")):
        try:
            limit = (cgroup / limit_name).read_text().strip()
            usage = int((cgroup / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" (v2) or a huge number (v1): no limit
            available = min(available, max(0, int(limit) - usage))
        break
    return available


def nvml_free_bytes() -> int:
    """Free memory of this process's first visible GPU, read through NVML (``pynvml``).

    Raises:
        Exception: whatever NVML raises (``NVMLError_LibraryNotFound`` on a machine without a driver).
    """
    import pynvml

    pynvml.nvmlInit()
    try:
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        if first.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    finally:
        pynvml.nvmlShutdown()


def nvml_device_count() -> int:
    """GPUs NVML sees on this machine; 0 where there is no NVML (no driver) or it fails."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, or pynvml missing: no GPU to count
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - a driver that fails to answer counts no GPU
        return 0
    finally:
        pynvml.nvmlShutdown()


def format_bytes(num_bytes: int) -> str:
    """``3.2 GiB``, ``640.0 MiB``: for start-up lines."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"
