"""Run the Triton kernels under the interpreter on machines without CUDA.

`triton.jit` decides at decoration time (when `kernels.triton_attention` is imported) whether a kernel
is compiled or interpreted, reading ``TRITON_INTERPRET`` then; importing `triton` itself earlier is
harmless. So this conftest, which pytest imports before the test modules of this folder, sets
``TRITON_INTERPRET=1`` when there is no CUDA device, and re-imports `kernels.triton_attention` if a
module collected earlier already imported it compiled.

With CUDA present nothing is set: the kernels compile and the CPU-style tests run on the GPU
(see ``kernel_device``); ``pytest -m gpu`` adds the bf16 and large-shape comparisons.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _module = sys.modules.get("kernels.triton_attention")
    if _module is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(_module._decode_split_kernel, InterpretedFunction):
            importlib.reload(_module)


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where the kernels under test run: CPU under the interpreter, else CUDA."""
    return torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
