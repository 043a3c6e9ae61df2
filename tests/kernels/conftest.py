"""Run the Triton kernels under the interpreter on machines without CUDA.

``TRITON_INTERPRET`` is read when Triton's own ``@triton.jit`` helpers (``tl.max``, ``tl.sum``, ...)
are decorated, i.e. when `triton` is first imported, so it must be set before that. Pytest imports
``tests/conftest.py`` before any test module, and it sets the variable for the whole run; this
conftest checks again so that running this folder on its own, or a future import order, cannot let
the kernels fail obscurely.

With CUDA present nothing is set: the kernels compile and the tests here run on the GPU too
(see ``kernel_device``); ``pytest -m gpu`` adds bf16 and large-shape comparisons.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1, so its "
            "kernels would not run on CPU; run with TRITON_INTERPRET=1 in the environment "
            "or set it in tests/conftest.py"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where the kernels under test run: CPU under the interpreter, else CUDA."""
    return torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


@pytest.fixture
def no_tf32():
    """GPU comparisons against the float32 reference: no TF32 matmuls for the duration of the test."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="session")
def base_kernels(tmp_path_factory: pytest.TempPathFactory):
    """The plain C++ variant (`kernels.isa`: no AVX2, AVX-512 or AVX512-BF16 instructions) built by
    `kernels.cpu_build.build` into a fresh cache in which a killed build's lock file was left behind: ``(module,
    cache directory)``. The build must remove the stale lock, not wait on it (pytest's timeout fails a hang)."""
    from kvrelay.kernels import cpu_build
    from kvrelay.kernels.isa import VARIANT_BY_NAME

    cache = tmp_path_factory.mktemp("kernel-cache")
    (cache / "base").mkdir()
    (cache / "base" / "lock").touch()  # what torch's builder leaves when killed mid-build
    module = cpu_build.build(VARIANT_BY_NAME["base"], cpu_build.CPU_KERNELS.sources, cache, wait_s=5.0)
    return module, cache
