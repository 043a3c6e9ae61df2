"""`LinearKernel`: ``y = x Wᵀ + b`` for one fixed weight, on the fastest path this machine has.

On a CPU with oneDNN, a bf16 weight is also kept in oneDNN's packed (blocked) layout and multiplied
with its packed-weight matmul: measured here for a 3072×576 bf16 weight, 2.5× faster than
``F.linear`` at 1 row, 2× at 16 rows, 1.3× at 300 rows, with bit-identical results (both accumulate
in float32). float32 weights are not packed: the packed path sums in another order (differences
of 1e-4), and float32 prefill is what the exactness tests pin against transformers. The packed copy costs
the weight's size again in memory. Packing uses torch's internal ``mkldnn`` ops (those its compiler
emits); where they are missing, where the CPU lacks bf16 matmul support (AVX2-only machines: oneDNN
needs AVX512-BF16/AMX or AVX-NE-CONVERT), or where they refuse a weight, the kernel falls back to
``F.linear``.

A bf16 or float32 weight is also kept in `kernels.cpu_small.block_weight`'s blocked layout for its C++ few-row
kernel. Which of the three a step of T rows takes is `model.kernel_plan`'s choice per row bucket, timed on the
machine (`engine.kernel_tuning`); until a plan is applied, the built-in rule: blocked at 1 to 16 rows, oneDNN's
packed matmul (bf16) or ``F.linear`` (float32) above. What the built-in rule came from:
* bf16 (VDPBF16PS with AVX512-BF16): on a Zen 4 VM a batch-1 SmolLM2 engine step took 0.58× the time with it; alone
  over SmolLM2's weights it took 0.5-1.05× oneDNN's packed matmul's time at 1 to 4 rows, 0.8-1.1× at 8, as the VM's
  memory moved, the same at 12, 1.13× at 16; at 9 to 16 rows it still pays through
  `model.llama.DecoderLayer.decode_fused`, which needs it (a batch-16 step 0.91×). Its sums run in another order
  than oneDNN's, so bf16 decode steps of up to sixteen rows differ from ``F.linear`` by at most a rounding of the
  bf16 result.
* float32 (fused multiply-adds, AVX-512 or AVX2): it reads the weights near the machine's read bandwidth, where
  MKL's matrix-vector path reaches about half of it; each output is summed in input order, within 1e-5 relative of
  ``F.linear``.

Each copy costs the weight's size again: until `LinearKernel.use` frees the ones its paths do not read, a float32
weight is held twice, a bf16 weight on a CPU with oneDNN bf16 support three times (row-major, oneDNN-packed,
blocked). The row-major one stays: it is the model's parameter. A model's blocked copies are then gathered into one
buffer on transparent huge pages in the order a decode step reads them (`colocate_blocked`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from kvrelay.kernels import cpu_small
from kvrelay.model.kernel_plan import bucket_of, builtin_linear_paths

log = logging.getLogger(__name__)
PACKED_DTYPES = (torch.bfloat16,)
PACK_ROWS_HINT = 16  # the batch the packing is tuned for; any row count works


class LinearKernel:
    """Multiply by one weight ``[out, in]`` (and add ``bias`` ``[out]``, if any); see module doc.

    Built with every copy this machine can use (row-major, oneDNN-packed, blocked) and `model.kernel_plan`'s
    built-in paths; `use` sets the path of each row bucket, `drop_unused` frees the copies no path reads.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.packed = _pack(weight)
        self.blocked_ext = cpu_small.load() if cpu_small.supports_blocked(weight, bias) else None
        self.blocked = cpu_small.block_weight(weight) if self.blocked_ext is not None else None
        # one `LINEAR_PATHS` name per `ROW_BUCKETS` bucket (set by `use`)
        self.paths: tuple[str, ...] = ()  # one `LINEAR_PATHS` name per `ROW_BUCKETS` bucket (`use`)
        self.use(builtin_linear_paths(packed=self.packed is not None))

    def can_take(self, path: str) -> bool:
        """Whether this weight has the copy ``path`` reads (``torch``: always)."""
        return path == "torch" or (path == "blocked" and self.blocked is not None) or (
            path == "onednn" and self.packed is not None)

    def use(self, paths: tuple[str, ...]) -> None:
        """Take ``paths``, one `LINEAR_PATHS` name per `ROW_BUCKETS` bucket; a path whose copy this weight lacks
        becomes ``torch``."""
        self.paths = tuple(p if self.can_take(p) else "torch" for p in paths)

    def drop_unused(self, *, keep_blocked: bool) -> None:
        """Free the packed and blocked copies no bucket's path reads (the blocked one stays with ``keep_blocked``:
        the one-call decode stack reads it). A freed copy is gone: no later `use` brings it back."""
        if "onednn" not in self.paths:
            self.packed = None
        if "blocked" not in self.paths and not keep_blocked:
            self.blocked = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` → ``[T, out]`` in ``x.dtype``, on the path of T's row bucket."""
        rows = x.shape[0] if x.dim() == 2 else 0
        return self.run(self.paths[bucket_of(rows)] if rows > 0 and x.device.type == "cpu" else "torch", x)

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` → ``[T, out]`` on ``path`` (one this weight `can_take`; ``blocked`` for ``x`` of the
        weight's dtype: else ``torch``)."""
        if path == "blocked" and x.dtype == self.weight.dtype:
            return cpu_small.blocked_linear(self.blocked_ext, x.contiguous(), self.blocked, self.bias,
                                            self.weight.shape[0])
        if path == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build can pack a weight of ``dtype`` (see module doc)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or not packing_supported(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
    except (AttributeError, RuntimeError) as exc:
        log.warning("oneDNN cannot pack a %s weight (%s); using F.linear", tuple(weight.shape), exc)
        return None


def colocate_blocked(kernels: list[LinearKernel]) -> bool:
    """Move the blocked copies of ``kernels`` (those that have one; a kernel listed twice moves once) into one
    buffer on transparent huge pages (`kernels.cpu_small.huge_page_buffer`), back to back in the order given: list
    them in the order a decode step reads them. Each ``kernel.blocked`` becomes a view of the buffer with the same
    shape and values; the old copies are freed once nothing else holds them, so anything that captured
    ``kernel.blocked`` before (`model.llama.DecoderLayer.prepare_fused`) must capture it again. Returns whether
    the huge pages were granted (the copies move either way)."""
    moving = list({id(k): k for k in kernels if k.blocked is not None}.values())
    if not moving:
        return False
    sizes = [k.blocked.numel() * k.blocked.element_size() for k in moving]
    buf, huge = cpu_small.huge_page_buffer(sum(sizes))
    start = 0
    for kernel, size in zip(moving, sizes, strict=True):
        old = kernel.blocked
        view = buf[start:start + size].view(old.dtype).view(old.shape)
        view.copy_(old)
        kernel.blocked = view
        start += size
    return huge
