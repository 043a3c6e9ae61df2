"""`LinearKernel`: past the few-row kernels' rows (`kernels.cpu_small`, tested there) the packed oneDNN matmul
gives F.linear's results for bf16; float32 keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvrelay.kernels import cpu_small
from kvrelay.model.linear_kernel import LinearKernel, packing_supported


@pytest.mark.parametrize("rows", [cpu_small.BLOCKED_MAX_ROWS + 1, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_packed_equals_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(192, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(192, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    kernel = LinearKernel(weight, bias)
    assert (kernel.packed is not None) == packing_supported(torch.bfloat16)
    got = kernel(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=0, rtol=0)


def test_float32_is_not_packed() -> None:
    """float32 is never packed: past the few-row kernel's rows (`kernels.cpu_small`, tested there) it is
    F.linear itself."""
    weight, x = torch.randn(8, 4), torch.randn(cpu_small.BLOCKED_MAX_ROWS + 1, 4)
    kernel = LinearKernel(weight, None)
    assert kernel.packed is None and torch.equal(kernel(x), F.linear(x, weight))
