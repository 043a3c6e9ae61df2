"""``kvrelay bench kernel``: paged decode attention, Triton vs the torch reference, as a share of HBM bandwidth.

Decode attention is memory-bound, so its figure of merit is bytes moved per second::

    bytes = K + V read (sum(seq_lens) * Hkv * D * itemsize * 2) + q read + out written

reported against two ceilings measured or read in the same run: the HBM peak from NVML (max memory
clock x bus width x 2 for DDR) and a device-to-device ``torch`` copy of a large buffer (read + write).
Times are the median of CUDA-event timings after warm-up; the smallest shape's KV (128 MiB) already
exceeds the H200's 60 MB L2. On a machine without CUDA only a tiny shape of the reference is timed,
so the command runs everywhere.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import emit, machine_label
from kernels import reference
from kvstore.block_spec import BlockSpec
from model.dtype import DTYPE_NAME_TO_TORCH

# (batch, seq_len_tokens); every sequence has the same length so the byte count is exact.
CUDA_SHAPES = ((8, 8192), (32, 1024), (32, 4096), (64, 2048), (64, 8192))
CUDA_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size_tokens=16, dtype="bfloat16")
CPU_SHAPES = ((4, 256),)
CPU_HEADS = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size_tokens=16, dtype="float32")
COPY_BYTES = 2 << 30


def hbm_peak_bytes_per_s(device_index: int) -> float | None:
    """Theoretical HBM bandwidth from NVML, or None where NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            mem_clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
            bus_width_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # any NVML failure (no library, no permission) just means no theoretical peak
        return None
    return mem_clock_mhz * 1e6 * bus_width_bits / 8 * 2


def time_cuda_ms(fn: Callable[[], object], *, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def time_cpu_ms(fn: Callable[[], object], *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bytes_per_s(device: torch.device, *, warmup: int, iters: int) -> float:
    """Device-to-device copy of `COPY_BYTES`, counting bytes read plus written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_cuda_ms(lambda: dst.copy_(src), warmup=warmup, iters=iters)
    return 2 * COPY_BYTES / (ms / 1e3)


def make_decode_inputs(batch: int, seq_len: int, heads: dict, device: torch.device, seed: int) -> dict:
    """Layer 0 of a two-layer pool, shuffled block tables, equal sequence lengths."""
    spec = BlockSpec(num_layers=2, num_kv_heads=heads["num_kv_heads"], head_dim=heads["head_dim"],
                     block_size_tokens=heads["block_size_tokens"], dtype=heads["dtype"])
    blocks_per_seq = -(-seq_len // spec.block_size_tokens)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = torch.randn(spec.pool_shape(num_blocks), generator=gen, device=device, dtype=spec.torch_dtype)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    q = torch.randn(batch, heads["num_q_heads"], spec.head_dim, generator=gen, device=device,
                    dtype=spec.torch_dtype)
    return dict(q=q, k_cache=pool[:, 0, 0], v_cache=pool[:, 0, 1],
                block_tables=ids.view(batch, blocks_per_seq).to(torch.int32).to(device),
                seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device))


def decode_bytes(batch: int, seq_len: int, heads: dict) -> int:
    itemsize = DTYPE_NAME_TO_TORCH[heads["dtype"]].itemsize
    kv = batch * seq_len * heads["num_kv_heads"] * heads["head_dim"] * itemsize * 2
    q_and_out = 2 * batch * heads["num_q_heads"] * heads["head_dim"] * itemsize
    return kv + q_and_out


def bench_shape(batch: int, seq_len: int, heads: dict, device: torch.device, *, iters: int,
                reference_iters: int) -> dict:
    args = make_decode_inputs(batch, seq_len, heads, device, seed=batch * 100_003 + seq_len)
    scale = heads["head_dim"] ** -0.5
    num_bytes = decode_bytes(batch, seq_len, heads)
    row: dict = {"batch": batch, "seq_len_tokens": seq_len, **heads, "bytes_moved": num_bytes}

    def run_reference() -> torch.Tensor:
        return reference.paged_decode_attention(**args, scale=scale)

    if device.type != "cuda":
        ref_ms = time_cpu_ms(run_reference, warmup=1, iters=reference_iters)
        row.update(reference_ms=round(ref_ms, 4), reference_bytes_per_s=num_bytes / (ref_ms / 1e3))
        return row

    from kernels import triton_attention

    def run_triton() -> torch.Tensor:
        return triton_attention.paged_decode_attention(**args, scale=scale)

    err = (run_triton().float() - run_reference().float()).abs().max().item()
    triton_ms = time_cuda_ms(run_triton, warmup=3, iters=iters)
    ref_ms = time_cuda_ms(run_reference, warmup=1, iters=reference_iters)
    max_blocks = args["block_tables"].shape[1]
    row.update(
        num_splits=triton_attention.decode_num_splits(max_blocks * heads["block_size_tokens"]),
        max_abs_err_vs_reference=err,
        triton_ms=round(triton_ms, 4),
        reference_ms=round(ref_ms, 4),
        triton_bytes_per_s=num_bytes / (triton_ms / 1e3),
        speedup_vs_reference=round(ref_ms / triton_ms, 2),
    )
    return row


def run_kernel_bench(*, iters: int = 20, reference_iters: int = 3) -> dict:
    """Benchmark paged decode attention on CUDA if present (else the reference on a tiny CPU shape).

    Returns a JSON-ready dict: machine label, ceilings (``hbm_peak_bytes_per_s`` from NVML,
    ``copy_bytes_per_s`` measured) and one row per shape with times in ms, bytes per second and the
    ratios ``frac_of_hbm_peak`` and ``frac_of_copy``.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    result: dict = {"bench": "kernel", **machine_label(), "torch": torch.__version__}
    if not cuda:
        result.update(device="cpu", note="no CUDA device: only the reference was timed, on a tiny shape",
                      shapes=[bench_shape(b, s, CPU_HEADS, device, iters=iters, reference_iters=reference_iters)
                              for b, s in CPU_SHAPES])
        return result

    import triton

    peak = hbm_peak_bytes_per_s(device.index or 0)
    copy = copy_bytes_per_s(device, warmup=3, iters=iters)
    result.update(device=torch.cuda.get_device_name(device), triton=triton.__version__,
                  hbm_peak_bytes_per_s=peak, copy_bytes_per_s=copy,
                  copy_frac_of_hbm_peak=round(copy / peak, 3) if peak else None)
    rows = []
    for batch, seq_len in CUDA_SHAPES:
        row = bench_shape(batch, seq_len, CUDA_HEADS, device, iters=iters, reference_iters=reference_iters)
        row["frac_of_hbm_peak"] = round(row["triton_bytes_per_s"] / peak, 3) if peak else None
        row["frac_of_copy"] = round(row["triton_bytes_per_s"] / copy, 3)
        rows.append(row)
        torch.cuda.empty_cache()
    result["shapes"] = rows
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench kernel", description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="timed calls of the Triton kernel per shape")
    p.add_argument("--reference-iters", type=int, default=3, help="timed calls of the reference per shape")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    emit(run_kernel_bench(iters=a.iters, reference_iters=a.reference_iters), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
