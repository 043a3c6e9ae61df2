"""Device names: ``auto`` (CUDA when this process sees a GPU, else the CPU), ``cpu``, ``cuda``, ``cuda:N``.

Importing this module loads no torch (configs are checked with `check_device_name` in the router process);
`resolve_device` imports it when it has ``auto`` to decide. ``auto`` is decided in the process that computes,
after ``CUDA_VISIBLE_DEVICES`` is set for it (`kvrelay up` sets one per node from ``<role>.devices``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

AUTO_DEVICE = "auto"
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> str:
    """``name`` when it is a device name kvrelay computes on.

    Raises:
        ValueError: anything else (``gpu``, ``mps``, ``cuda:x``), naming the accepted forms.
    """
    if not isinstance(name, str) or not DEVICE_PATTERN.fullmatch(name):
        raise ValueError("is not a device; use auto, cpu, cuda or cuda:N")
    return name


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def resolve_device(name: str, *, cuda_available: Callable[[], bool] = _cuda_available) -> str:
    """The device to compute on: ``name`` itself, or for ``auto`` ``cuda`` when ``cuda_available()`` (default
    ``torch.cuda.is_available()``) else ``cpu``.

    Raises:
        ValueError: ``name`` is not a device name (`check_device_name`).
    """
    check_device_name(name)
    if name != AUTO_DEVICE:
        return name
    return "cuda" if cuda_available() else "cpu"
