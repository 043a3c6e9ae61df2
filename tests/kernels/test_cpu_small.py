"""The C++ small decode ops (`kernels.cpu_small`) against float64 math, and where the model uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvrelay.kernels import cpu_small
from kvrelay.model.linear_kernel import LinearKernel


@pytest.fixture(scope="module")
def ext():
    built = cpu_small.load()
    assert built is not None, "the C++ small linear kernel did not build here (g++ and ninja are installed)"
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17])  # tiles of four rows and their rest
@pytest.mark.parametrize("shape", [(960, 576), (1, 576), (3, 5), (17, 33), (1539, 576), (49, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_blocked_linear_equals_a_float64_product(ext, rows: int, shape: tuple[int, int], bias: bool) -> None:
    out, inp = shape
    g = torch.Generator().manual_seed(rows * 1000 + out + inp)
    x = torch.randn(rows, inp, generator=g)
    w = torch.randn(out, inp, generator=g) * 0.05
    b = torch.randn(out, generator=g) if bias else None
    blocked = cpu_small.block_weight(w)
    assert blocked.shape == (-(-out // 16), inp, 16, 1)
    got = cpu_small.blocked_linear(ext, x, blocked, b, out)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_float32_block_weight_layout() -> None:
    """Block (g, i) holds output rows 16g..16g+15 at input i; padding is zero."""
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    blocked = cpu_small.block_weight(w)
    assert blocked.shape == (2, 3, 16, 1)
    assert torch.equal(blocked[0, 2, 5, 0], w[5, 2]) and torch.equal(blocked[1, 1, 3, 0], w[19, 1])
    assert blocked[1, :, 4:].abs().sum() == 0


def test_float32_blocked_linear_refuses_bad_inputs_by_name(ext) -> None:
    w = cpu_small.block_weight(torch.randn(20, 6))
    x = torch.randn(1, 6)
    with pytest.raises(RuntimeError, match="x has 7 columns, wb 6 steps of 1"):
        cpu_small.blocked_linear(ext, torch.randn(1, 7), w, None, 20)
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        cpu_small.blocked_linear(ext, x.double(), w, None, 20)
    with pytest.raises(RuntimeError, match="x and wb must have one dtype"):
        cpu_small.blocked_linear(ext, x.bfloat16(), w, None, 20)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        cpu_small.blocked_linear(ext, torch.randn(6, 2).t(), w, None, 20)
    with pytest.raises(RuntimeError, match="bias must be Float \\[out\\]"):
        cpu_small.blocked_linear(ext, x, w, torch.randn(7), 20)


def test_linear_kernel_takes_blocked_for_float32_at_up_to_its_rows_only(ext, monkeypatch) -> None:
    w, b = torch.randn(40, 32), torch.randn(40)
    kernel = LinearKernel(w, b)
    assert kernel.blocked_ext is ext and kernel.blocked is not None
    calls: list[int] = []
    real = cpu_small.blocked_linear
    monkeypatch.setattr(cpu_small, "blocked_linear", lambda e, x, *a: calls.append(x.shape[0]) or real(e, x, *a))
    for rows in (1, cpu_small.BLOCKED_MAX_ROWS, cpu_small.BLOCKED_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls == [1, cpu_small.BLOCKED_MAX_ROWS]
    # A non-contiguous x is copied, not refused; another dtype keeps F.linear
    x = torch.randn(32, 3)[:, :1].t()
    torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert LinearKernel(w.double(), None).blocked_ext is None


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
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        ext.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-6)


def test_rms_norm_in_bf16_equals_llama_s_cast_then_scale(ext) -> None:
    """bf16: normalised in float32, rounded to bf16, then scaled by the bf16 weight (`model.llama.RMSNorm`)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(33, 576, generator=g) * 3).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    got = cpu_small.rms_norm(ext, x, w, 1e-5)
    want = w * F.rms_norm(x.double(), (576,), eps=1e-5).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # float32 sums against float64: the normalised value may round to the neighbouring bf16, no further
    torch.testing.assert_close(got.double(), want.double(), rtol=2**-7, atol=0)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        ext.rms_norm(x, w.float(), 1e-6)


def test_the_model_s_rms_norm_takes_it_for_float32_and_bf16(ext) -> None:
    from kvrelay.model.llama import RMSNorm

    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(4, 64)
    assert norm.fast is None and torch.equal(norm(x), norm.weight * torch.nn.functional.rms_norm(x, (64,), eps=1e-6))
    norm.prepare()
    assert norm.fast is ext
    want = norm.weight * torch.nn.functional.rms_norm(x, (64,), eps=1e-6)
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(norm(x), cpu_small.rms_norm(ext, x, norm.weight, 1e-6))
    xb = x.bfloat16()  # a float32 weight over bf16 x keeps torch's path (float32 out)
    assert torch.equal(norm(xb), norm.weight * torch.nn.functional.rms_norm(xb.float(), (64,), eps=1e-6).bfloat16())
    bf = RMSNorm(64, 1e-6).bfloat16()
    bf.weight.data.normal_()
    torch_path = bf(xb)
    bf.prepare()
    assert bf.fast is ext and torch.equal(bf(xb), cpu_small.rms_norm(ext, xb, bf.weight, 1e-6))
    torch.testing.assert_close(bf(xb).double(), torch_path.double(), rtol=2**-7, atol=0)
    gpt_oss = RMSNorm(64, 1e-6, scale_in_float32=True).bfloat16()  # scaled before the cast: torch's path
    gpt_oss.prepare()
    assert gpt_oss.fast is None


def _bf16_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33])  # tiles of sixteen rows and their rest
@pytest.mark.parametrize("shape", [(960, 576), (3, 5), (17, 33), (49, 1536)])  # whole and partial groups, odd in
@pytest.mark.parametrize("bias", [False, True])
def test_blocked_linear_equals_a_float64_product_rounded_to_bf16(ext, rows: int, shape: tuple[int, int],
                                                                  bias: bool) -> None:
    out, inp = shape
    g = torch.Generator().manual_seed(rows * 100 + out + inp)
    x = torch.randn(rows, inp, generator=g).bfloat16()
    w = (torch.randn(out, inp, generator=g) * 0.05).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    blocked = cpu_small.block_weight(w)
    assert blocked.shape == (-(-out // 16), -(-inp // 2), 16, 2)
    got = cpu_small.blocked_linear(ext, x, blocked, b, out)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    want = _bf16_product(x, w, b)
    # float32 sums of exact bf16 products: at most the neighbouring bf16 of the float64 result
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-4)


def test_block_weight_layout() -> None:
    """Block (g, j) holds output rows 16g..16g+15 by inputs 2j, 2j+1; padding is zero."""
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3).bfloat16()
    blocked = cpu_small.block_weight(w)
    assert blocked.shape == (2, 2, 16, 2)
    assert torch.equal(blocked[0, 0, 5], w[5, 0:2]) and torch.equal(blocked[1, 1, 3, 0], w[19, 2])
    assert blocked[1, 1, 3, 1] == 0 and blocked[1, 0, 4:].abs().sum() == 0


def test_blocked_linear_refuses_bad_inputs_by_name(ext) -> None:
    w = cpu_small.block_weight(torch.randn(20, 6).bfloat16())
    x = torch.randn(1, 6).bfloat16()
    with pytest.raises(RuntimeError, match="x has 7 columns, wb 3 steps of 2"):
        cpu_small.blocked_linear(ext, torch.randn(1, 7).bfloat16(), w, None, 20)
    with pytest.raises(RuntimeError, match="x and wb must have one dtype"):
        cpu_small.blocked_linear(ext, x.float(), w, None, 20)
    with pytest.raises(RuntimeError, match="33 outputs do not fit 2 groups of 16"):
        cpu_small.blocked_linear(ext, x, w, None, 33)
    with pytest.raises(RuntimeError, match="bias must be BFloat16 \\[out\\]"):
        cpu_small.blocked_linear(ext, x, w, torch.randn(19).bfloat16(), 20)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        cpu_small.blocked_linear(ext, torch.randn(6, 2).bfloat16().t(), w, None, 20)


def test_linear_kernel_takes_blocked_for_bf16_at_up_to_its_rows_only(ext, monkeypatch) -> None:
    w, b = (torch.randn(40, 32) * 0.1).bfloat16(), torch.randn(40).bfloat16()
    kernel = LinearKernel(w, b)
    assert kernel.blocked_ext is ext
    calls: list[int] = []
    real = cpu_small.blocked_linear
    monkeypatch.setattr(cpu_small, "blocked_linear", lambda e, x, *a: calls.append(x.shape[0]) or real(e, x, *a))
    for rows in (1, cpu_small.BLOCKED_MAX_ROWS, cpu_small.BLOCKED_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 32).bfloat16()
        torch.testing.assert_close(kernel(x).double(), _bf16_product(x, w, b), rtol=2**-7, atol=1e-4)
    assert calls == [1, cpu_small.BLOCKED_MAX_ROWS]
    assert LinearKernel(w.double(), None).blocked_ext is None


def test_blocked_linear_without_vector_instructions_gives_the_same_results(base_kernels) -> None:
    """The plain C++ paths (CPUs without AVX512-BF16, AVX-512 or AVX2: the ``base`` variant of `kernels.isa`) sum the
    same layouts in float32: they agree with the product as the vector paths do (the linear layer in bf16 and
    float32, the prefill attention, which shares its cores, and the decode attention's bf16 passes)."""
    plain, _ = base_kernels
    g = torch.Generator().manual_seed(3)
    for rows, (out, inp) in ((1, (960, 576)), (17, (17, 33))):
        x = torch.randn(rows, inp, generator=g).bfloat16()
        w = (torch.randn(out, inp, generator=g) * 0.05).bfloat16()
        b = torch.randn(out, generator=g).bfloat16()
        got = cpu_small.blocked_linear(plain, x, cpu_small.block_weight(w), b, out)
        torch.testing.assert_close(got.double(), _bf16_product(x, w, b), rtol=2**-7, atol=1e-4)
        x, w, b = x.float(), w.float(), b.float()
        got = cpu_small.blocked_linear(plain, x, cpu_small.block_weight(w), b, out)
        torch.testing.assert_close(got.double(), _bf16_product(x, w, b), rtol=1e-5, atol=1e-5)
    # the flash-style prefill attention runs on the same cores
    from kvrelay.kernels import cpu_attention, reference

    from tests.kernels.test_cpu_attention import PREFILL_LONG, _assert_prefill_close, _prefill_inputs

    args = _prefill_inputs(PREFILL_LONG, 3, seed=5)
    _assert_prefill_close(cpu_attention.prefill_attention(plain, *args, scale=0.125), *args)
    # and the decode attention's bf16 passes
    q, k_cache, v_cache, tables, seq_lens, _ = args
    got = cpu_attention.paged_decode_attention(plain, q[:4], k_cache, v_cache, tables, seq_lens, scale=0.125)
    want = reference.paged_decode_attention(q[:4].float(), k_cache.float(), v_cache.float(), tables, seq_lens,
                                            scale=0.125)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_apply_rotary_bit_for_bit(ext, dtype: torch.dtype) -> None:
    from kvrelay.model.rope import apply_rotary

    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(19, 960, generator=g).to(dtype)
    x = qkv[:, :768].reshape(19, 12, 64)  # strided rows, as the split of a fused q/k/v matmul
    angles = torch.randn(19, 64, generator=g) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = cpu_small.rotary(ext, x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, apply_rotary(x, cos, sin))
    with pytest.raises(RuntimeError, match="x must be \\[T, H, D\\] \\(D even\\) and cos, sin \\[T, D\\]"):
        ext.rotary(x, cos[:, :32].contiguous(), sin[:, :32].contiguous())
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        ext.rotary(x.double(), cos, sin)
    with pytest.raises(RuntimeError, match="last dimension, cos and sin must be contiguous"):
        ext.rotary(torch.randn(19, 12, 128).to(dtype)[..., ::2], cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_torch_s_ops(ext, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(12)
    gate_up = (torch.randn(9, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_small.silu_mul(ext, gate_up)
    want = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == (9, 1536)
    if dtype == torch.float32:  # its exp and division may differ from torch's in the last float32 bit
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        # Two bf16 roundings (silu's result, then the product) put torch's own result up to ~1.4 bf16 units in the
        # last place from the exact product; an exp a float32 bit away (the vector exp) can round silu's result the
        # other way at a midpoint, so the two may be two units apart. Both stay within the two roundings' bound.
        x = gate.double()
        exact = x / (1 + torch.exp(-x)) * up.double()
        unit = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)  # bf16's unit at each value
        for result in (got, want):
            assert ((result.double() - exact).abs() / unit).max() <= 1.5
        assert (got == want).float().mean() > 0.99
    with pytest.raises(RuntimeError, match="gate_up must be \\[T, 2 I\\]"):
        ext.silu_mul(gate_up[:, :5])
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        ext.silu_mul(gate_up.double())


def test_the_model_rotates_and_activates_through_them(ext) -> None:
    """`Attention` and `MLP` take the C++ rotary and silu_mul once prepared on the CPU, with the same results."""
    from kvrelay.model.config import ModelConfig
    from kvrelay.model.llama import MLP, Attention

    config = ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 32})
    attn, mlp = Attention(config), MLP(config)
    assert attn.small_ops is None and mlp.small_ops is None
    x = torch.randn(3, 64)
    before = mlp(x)
    attn.prepare()
    mlp.prepare()
    assert attn.small_ops is ext and mlp.small_ops is ext
    torch.testing.assert_close(mlp(x), before, rtol=1e-5, atol=1e-6)


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_buffer_starts_on_a_huge_page_and_gets_huge_pages() -> None:
    nbytes = 5 * cpu_small.HUGE_PAGE + 12345  # a tail past the last whole page
    buf, advised = cpu_small.huge_page_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
    assert buf.data_ptr() % cpu_small.HUGE_PAGE == 0
    buf.fill_(3)
    assert int(buf.sum()) == 3 * nbytes
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" not in mode:  # the kernel grants them (this machine: "madvise")
        assert advised and _anon_huge_kb(buf.data_ptr()) >= 2048
    empty, advised_empty = cpu_small.huge_page_buffer(0)
    assert empty.numel() == 0 and advised_empty is False
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        cpu_small.huge_page_buffer(-1)
