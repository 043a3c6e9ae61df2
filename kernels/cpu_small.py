"""Small float32 CPU ops of a decode step (`kernels/csrc/small_ops.cpp`): a linear layer for a few rows, and RMSNorm.

At 1 to 16 rows a float32 linear layer reads every weight once and does little else: it is bound by memory
bandwidth. oneDNN/MKL's matrix-vector path reads SmolLM2's weights at ~10 GB/s on this 2-core machine, whose
read bandwidth is ~20 GB/s, and its few-row path (2 to 16 rows) at ~5 GB/s. The extension reads eight weight
rows at a time against each load of ``x`` (measured on the AVX2 VM with four rows, on SmolLM2's 121 weights: 1.6×
F.linear at 1 row, 3.1× at 2, 2.1× at 8, 1.3× at 16, even at 32; eight rows gave 5-25% more GB/s than four at 1
and 4 rows on a Zen 4 VM, for its AVX-512 and its AVX2 code alike). `model.linear_kernel.LinearKernel` uses it
for float32 weights at up to `MAX_ROWS` rows; ``KVRELAY_CPU_KERNELS=0`` turns it off with the other C++ CPU kernels.

`rms_norm` is Llama's RMSNorm in one pass per row: torch's composite (pow, mean, add, rsqrt, mul) took ~70 µs
per call on a 576-wide row here, 61 calls a step (~4 ms of a ~48 ms batch-1 step); `model.llama.RMSNorm` uses
it for float32.

It is compiled on first use with torch's C++ extension builder (cached per machine); if that fails, the caller
keeps F.linear.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.cpu_build import CPU_KERNELS

MAX_ROWS = 16  # measured: equal to F.linear at 32 rows, faster below


def load() -> ModuleType | None:
    """The compiled extension (`kernels.cpu_build.CPU_KERNELS`, built on first call), or None when disabled or the
    build failed."""
    return CPU_KERNELS.load()


def small_linear(ext: ModuleType, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` through ``ext``: x float32 ``[T, in]`` contiguous, weight float32 ``[out, in]``
    contiguous, bias float32 ``[out]`` or None; returns float32 ``[T, out]``. Same values as F.linear up to the
    order of the sums (within 1e-5 relative of a float64 product here).

    Raises:
        RuntimeError: naming the shape, dtype or layout that does not fit.
    """
    return ext.small_linear(x, weight, bias)


def rms_norm(ext: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x * rsqrt(mean(x², -1) + eps)) * weight`` through ``ext``: x float32 ``[..., H]`` (copied if not
    contiguous), weight float32 ``[H]`` contiguous; returns float32 of x's shape. Same values as
    ``weight * F.rms_norm(x, (H,), eps=eps)`` up to the order of the sum of squares.

    Raises:
        RuntimeError: naming the shape, dtype or layout that does not fit.
    """
    h = x.shape[-1]
    return ext.rms_norm(x.reshape(-1, h).contiguous(), weight, eps).view(x.shape)


def supports(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `small_linear` takes this weight (and bias)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))
