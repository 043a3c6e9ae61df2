"""Weight and KV dtypes by name, and ``auto``: bf16 where the hardware computes it fast, else fp32.

``auto`` is bf16 on CUDA and on CPUs with AMX or AVX512-BF16 (bf16 matmuls there run 4–7× faster than
fp32 at serving batch sizes: see docs/design.md §9), fp32 elsewhere, where bf16 is emulated and slower.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kvrelay.model.dtype_names import AUTO, DTYPE_CHOICES, DTYPE_NAMES

DTYPE_NAME_TO_TORCH: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
__all__ = ["AUTO", "DTYPE_CHOICES", "DTYPE_NAME_TO_TORCH", "cpu_flags", "resolve_dtype"]
BF16_CPU_FLAGS: frozenset[str] = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags Linux reports (empty where there is no ``/proc/cpuinfo``)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def resolve_dtype(name: str, device: str | torch.device, *, flags: frozenset[str] | None = None) -> str:
    """``name`` itself, or for ``auto`` the dtype to serve in on ``device`` (see module doc).

    Raises:
        ValueError: ``name`` is neither ``auto`` nor one of `DTYPE_NAME_TO_TORCH`.
    """
    if name != AUTO:
        if name not in DTYPE_NAME_TO_TORCH:
            raise ValueError(f"dtype {name!r} is not supported; use one of {list(DTYPE_CHOICES)}")
        return name
    if torch.device(device).type == "cuda":
        return "bfloat16"
    return "bfloat16" if (cpu_flags() if flags is None else flags) & BF16_CPU_FLAGS else "float32"
