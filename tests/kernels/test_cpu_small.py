"""The C++ small decode ops (`kernels.cpu_small`) against float64 math, and where the model uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_small
from model.linear_kernel import LinearKernel


@pytest.fixture(scope="module")
def ext():
    built = cpu_small.load()
    assert built is not None, "the C++ small linear kernel did not build here (g++ and ninja are installed)"
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("out_features", [1, 3, 4, 7, 960, 1539])  # whole groups of four rows, and the rest
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_equals_a_float64_product(ext, rows: int, out_features: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, 576, generator=g)
    w = torch.randn(out_features, 576, generator=g) * 0.05
    b = torch.randn(out_features, generator=g) if bias else None
    got = cpu_small.small_linear(ext, x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name(ext) -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="x has 15 columns, w 16"):
        cpu_small.small_linear(ext, torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="must be float32"):
        cpu_small.small_linear(ext, torch.randn(1, 16, dtype=torch.float64), w, None)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        cpu_small.small_linear(ext, torch.randn(16, 2).t(), w, None)
    with pytest.raises(RuntimeError, match="bias must be float32 \\[out\\]"):
        cpu_small.small_linear(ext, torch.randn(1, 16), w, torch.randn(7))


def test_linear_kernel_takes_it_for_float32_at_up_to_max_rows_only(ext, monkeypatch) -> None:
    w, b = torch.randn(40, 32), torch.randn(40)
    kernel = LinearKernel(w, b)
    assert kernel.small is ext
    calls: list[int] = []
    real = cpu_small.small_linear
    monkeypatch.setattr(cpu_small, "small_linear", lambda e, x, *a: calls.append(x.shape[0]) or real(e, x, *a))
    for rows in (1, cpu_small.MAX_ROWS, cpu_small.MAX_ROWS + 1, 64):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls == [1, cpu_small.MAX_ROWS]
    # A non-contiguous x is copied, not refused; other dtypes and a non-contiguous weight keep F.linear
    x = torch.randn(32, 3)[:, :1].t()
    torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert LinearKernel(w.double(), None).small is None
    assert LinearKernel(torch.randn(32, 40).t(), None).small is None


@pytest.mark.parametrize("shape", [(1, 576), (3, 576), (200, 64), (2, 5, 64)])
def test_rms_norm_equals_a_float64_norm(ext, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    got = cpu_small.rms_norm(ext, x, w, 1e-5)
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # A strided view is copied first, not read wrong
    torch.testing.assert_close(cpu_small.rms_norm(ext, x.transpose(0, -1).transpose(0, -1), w, 1e-5), got)


def test_rms_norm_refuses_bad_inputs_by_name(ext) -> None:
    with pytest.raises(RuntimeError, match="x must be \\[T, H\\] and w \\[H\\]"):
        ext.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="must be float32"):
        ext.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-6)


def test_the_model_s_rms_norm_takes_it_for_float32_only(ext) -> None:
    from model.llama import RMSNorm

    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(4, 64)
    assert norm.fast is None and torch.equal(norm(x), norm.weight * torch.nn.functional.rms_norm(x, (64,), eps=1e-6))
    norm.prepare()
    assert norm.fast is ext
    want = norm.weight * torch.nn.functional.rms_norm(x, (64,), eps=1e-6)
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(norm(x), cpu_small.rms_norm(ext, x, norm.weight, 1e-6))
    xb = x.bfloat16()  # bf16 keeps torch's path: cast back before scaling, as Llama does
    assert torch.equal(norm(xb), norm.weight * torch.nn.functional.rms_norm(xb.float(), (64,), eps=1e-6).bfloat16())
