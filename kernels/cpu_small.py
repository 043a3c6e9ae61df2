"""Small CPU ops of a decode step (`kernels/csrc/small_ops.cpp`): linear layers for a few rows, RMSNorm, rotary,
silu × up.

At 1 to 16 rows a linear layer reads every weight once and does little else: it is bound by memory bandwidth.
oneDNN/MKL's matrix-vector path read SmolLM2's float32 weights at ~10 GB/s on a 2-core AVX2 VM whose read
bandwidth is ~20 GB/s (~5 GB/s at 2 to 16 rows), and oneDNN's packed bf16 matmul at ~20 GB/s on a Zen 4 VM that
reads 35-50 GB/s. `blocked_linear` is this package's few-row linear layer: the weight is copied once into
`block_weight`'s layout (sixteen output rows by one float32 or two bf16 inputs per 64-byte block) so that each
group of sixteen outputs reads one linear stream, summed with fused multiply-adds in float32 (AVX-512 or AVX2) or,
for bf16, AVX512-BF16's VDPBF16PS where the CPU has it (plain C++ elsewhere).
* bf16, Zen 4 VM: a batch-1 SmolLM2 engine step took 0.58× the time with it than with oneDNN's packed matmul
  (side by side in one process); alone, over SmolLM2's weights, the two ran from 2× apart to even as the VM's
  memory moved (a row-major layout summed eight rows at a time: ~0.65× the blocked one's speed).
* float32, Zen 1 VM (AVX2), over SmolLM2's 121 weights: even with the row-major eight-row kernel it replaced at one
  row (both at ~17-18 GB/s, the read bandwidth), 1.2-1.4× its speed at 4, 8 and 16 rows.
`model.linear_kernel.LinearKernel` uses it at up to `BLOCKED_MAX_ROWS` rows where `model.kernel_plan` (timed on the
machine) says it is the fastest; ``KVRELAY_CPU_KERNELS=0`` turns it off
with the other C++ CPU kernels.

`rms_norm` is Llama's RMSNorm in one pass per row: torch's composite (pow, mean, add, rsqrt, mul) took ~70 µs
per call on a 576-wide row here, 61 calls a step (~4 ms of a ~48 ms batch-1 step); `model.llama.RMSNorm` uses
it for float32 and for bf16 (~27 µs a call through torch on a Zen 4 VM).

`rotary` and `silu_mul` replace five and three torch ops of each layer with one pass each, rounding as those ops
do. ``kernels/csrc/decode_layer.cpp`` chains all of them (and the decode attention of `kernels.cpu_attention`)
into one call per decoder layer: `model.llama.DecoderLayer.decode_fused`.

It is compiled on first use with torch's C++ extension builder (cached per machine); if that fails, the caller
keeps F.linear.
"""

from __future__ import annotations

import mmap
from types import ModuleType

import torch
from kvrelay.kernels.cpu_build import CPU_KERNELS

BLOCKED_MAX_ROWS = 16  # the most rows `model.kernel_plan` may give blocked_linear and the fused decode layer (on a
# Zen 4 VM: equal to oneDNN's packed matmul at 12 rows, 1.13x its time at 16; a fused batch-16 SmolLM2 step 0.91x)


def load() -> ModuleType | None:
    """The compiled extension (`kernels.cpu_build.CPU_KERNELS`, built on first call), or None when disabled or the
    build failed."""
    return CPU_KERNELS.load()


def rms_norm(ext: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x * rsqrt(mean(x², -1) + eps)) * weight`` through ``ext``: x float32 or bf16 ``[..., H]`` (copied if not
    contiguous), weight ``[H]`` of x's dtype, contiguous; returns x's dtype and shape. float32: the values of
    ``weight * F.rms_norm(x, (H,), eps=eps)`` up to the order of the sum of squares; bf16: Llama's
    ``weight * F.rms_norm(x.float(), (H,), eps=eps).bfloat16()`` likewise.

    Raises:
        RuntimeError: naming the shape, dtype or layout that does not fit.
    """
    h = x.shape[-1]
    return ext.rms_norm(x.reshape(-1, h).contiguous(), weight, eps).view(x.shape)


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` bf16 or float32 ``[out, in]`` in `blocked_linear`'s layout: ``[ceil(out/16), ceil(in/P), 16, P]``
    (sixteen output rows by ``P`` inputs per block, ``P`` = 2 for bf16 and 1 for float32: one 32-bit word a lane),
    zero-padded, contiguous: a copy, the weight's size again."""
    out, inp = weight.shape
    per_word = 4 // weight.element_size()
    g, k = -(-out // 16), -(-inp // per_word)
    padded = torch.zeros(g * 16, k * per_word, dtype=weight.dtype)
    padded[:out, :inp] = weight
    return padded.view(g, 16, k, per_word).permute(0, 2, 1, 3).contiguous()


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """A new uint8 ``[nbytes]`` tensor (zeroed, not yet touched) that starts on a `HUGE_PAGE` boundary, its whole
    pages advised onto transparent huge pages (``madvise(MADV_HUGEPAGE)``) before anything touches them, and
    whether the advice was taken (False off Linux or where the kernel refuses it: the buffer then has the
    kernel's usual pages). Holds up to two `HUGE_PAGE` more than ``nbytes``; the memory is unmapped when the last
    tensor over it goes.

    The buffer is a fresh anonymous mapping of its own, not memory from torch's allocator: the allocator (glibc)
    hands back memory that earlier tensors freed, already faulted in on 4 KiB pages, and the advice does not
    change pages that exist: run after the attention tests, the buffer got no huge page at all (Zen 4 VM).

    Why: a decode step streams every weight once, and with 4 KiB pages the CPU's stream prefetchers stop at each
    page's end; with 2 MiB pages a batch-1 SmolLM2 bf16 step ran 1.14x as fast (median of 14 alternated pairs in
    one process, Zen 4 VM; 1.0-1.34x as the VM's memory moved), with torch's own huge pages for tensors of 2 MiB
    and more already on (`THP_MEM_ALLOC_ENABLE`, which misses the many smaller weights and their tails).

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"huge_page_buffer: nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), False
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole pages: the advice covers the last one too
    # anonymous and private (a shared mapping would be shmem, whose huge pages another switch governs)
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping for as long as a view of it lives
    offset = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[offset:offset + nbytes]  # offset + span <= len(raw): the advised pages lie inside raw
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return buf, False
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError:
        return buf, False
    return buf, True


def blocked_linear(ext: ModuleType, x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                   out: int) -> torch.Tensor:
    """``x @ weight.T + bias`` through ``ext`` for ``blocked = block_weight(weight)``: x ``[T, in]`` contiguous, of
    the weight's dtype (bf16 or float32), bias ``[out]`` of that dtype or None, ``out`` the weight's rows; returns
    ``[T, out]`` of x's dtype. bf16: the float32 sums rounded once (within one bf16 rounding of a float64
    product); float32: each output summed in input order with fused multiply-adds (within 1e-5 relative of a
    float64 product at these widths; F.linear sums in another order).

    Raises:
        RuntimeError: naming the shape, dtype or layout that does not fit.
    """
    return ext.blocked_linear(x, blocked, bias, out)


def supports_blocked(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `blocked_linear` takes this weight (and bias): bf16 or float32 on the CPU, the bias of its dtype."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32) and weight.dim() == 2
            and (bias is None or (bias.dtype == weight.dtype and bias.dim() == 1)))


def rotary(ext: ModuleType, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`model.rope.apply_rotary` through ``ext``: x float32 or bf16 ``[T, H, D]`` (last dimension contiguous),
    cos and sin ``[T, D]`` of x's dtype; returns a new contiguous ``[T, H, D]``, bit for bit as torch's ops.

    Raises:
        RuntimeError: naming the shape, dtype or layout that does not fit.
    """
    return ext.rotary(x, cos.contiguous(), sin.contiguous())


def silu_mul(ext: ModuleType, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` through ``ext`` for ``gate, up = gate_up.chunk(2, -1)``: gate_up float32 or bf16
    ``[T, 2I]`` (last dimension contiguous); returns ``[T, I]`` of its dtype (bf16: silu rounded to bf16 before the
    product, as torch's two ops; its exp may differ from torch's in the last float32 bit).

    Raises:
        RuntimeError: naming the shape, dtype or layout that does not fit.
    """
    return ext.silu_mul(gate_up)
