"""``kvrelay bench kernel``: paged decode attention, Triton vs the torch reference, as a share of HBM bandwidth;
and prefill attention through the unified kernel (`kernels.triton_unified`) as a share of the bf16 matmul rate.

Decode attention is memory-bound, so its figure of merit is bytes moved per second::

    bytes = K + V read (sum(seq_lens) * Hkv * D * itemsize * 2) + q read + out written

reported against two ceilings measured or read in the same run: the HBM peak from NVML (max memory
clock x bus width x 2 for DDR) and a device-to-device ``torch`` copy of a large buffer (read + write).
Times are the median of CUDA-event timings after warm-up; the smallest shape's KV (128 MiB) already
exceeds the H200's 60 MB L2. Decode rows time both the split-K decode kernel and the unified kernel (one
query per sequence). Prefill rows (``prefill``) time the unified kernel on causal chunks with and without a
cached prefix: ``flops = 4 · Hq · D · sum over queries of the keys each attends to``, against a bf16
8192³ ``torch.matmul`` measured in the same run and the datasheet's dense bf16 peak (``--peak-tflops``,
989 for an H200). On a machine without CUDA only a tiny shape of the reference is timed, so the command
runs everywhere.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from kvrelay.benchmarks.common import emit, machine_label
from kvrelay.kernels import reference
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.model.dtype import DTYPE_NAME_TO_TORCH

# (batch, seq_len_tokens); every sequence has the same length so the byte count is exact.
CUDA_SHAPES = ((8, 8192), (32, 1024), (32, 4096), (64, 2048), (64, 8192), (4, 32768))
# (number of sequences, cached prefix tokens, new tokens per sequence)
PREFILL_SHAPES = ((1, 0, 8192), (4, 0, 2048), (1, 8192, 2048))
H200_BF16_DENSE_TFLOPS = 989.0
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


def time_cuda_graph_ms(fn: Callable[[], object], *, warmup: int, iters: int, launches: int = 10) -> float:
    """Median milliseconds of one ``fn`` replayed from a CUDA graph of ``launches`` back-to-back calls, as the
    engine's captured decode step runs it: the launcher's host work (argument checks, scratch allocation,
    Triton's dispatch) is left out, which `time_cuda_ms` counts whenever it outlasts the kernel."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return time_cuda_ms(graph.replay, warmup=2, iters=iters) / launches


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

    from kvrelay.kernels import triton_attention, triton_unified

    def run_triton() -> torch.Tensor:
        return triton_attention.paged_decode_attention(**args, scale=scale)

    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)

    def run_unified() -> torch.Tensor:
        return triton_unified.unified_attention(**args, query_start_loc=starts, scale=scale)

    err = (run_triton().float() - run_reference().float()).abs().max().item()
    unified_err = (run_unified().float() - run_reference().float()).abs().max().item()
    triton_ms = time_cuda_ms(run_triton, warmup=3, iters=iters)
    unified_ms = time_cuda_ms(run_unified, warmup=3, iters=iters)
    triton_graph_ms = time_cuda_graph_ms(run_triton, warmup=3, iters=iters)
    unified_graph_ms = time_cuda_graph_ms(run_unified, warmup=3, iters=iters)
    ref_ms = time_cuda_ms(run_reference, warmup=1, iters=reference_iters)
    max_blocks = args["block_tables"].shape[1]
    row.update(
        num_splits=triton_attention.decode_num_splits(max_blocks * heads["block_size_tokens"]),
        max_abs_err_vs_reference=err,
        triton_ms=round(triton_ms, 4),
        reference_ms=round(ref_ms, 4),
        triton_bytes_per_s=num_bytes / (triton_ms / 1e3),
        speedup_vs_reference=round(ref_ms / triton_ms, 2),
        unified_max_abs_err_vs_reference=unified_err,
        unified_ms=round(unified_ms, 4),
        unified_bytes_per_s=num_bytes / (unified_ms / 1e3),
        triton_graph_ms=round(triton_graph_ms, 4),
        triton_graph_bytes_per_s=num_bytes / (triton_graph_ms / 1e3),
        unified_graph_ms=round(unified_graph_ms, 4),
        unified_graph_bytes_per_s=num_bytes / (unified_graph_ms / 1e3),
    )
    return row


def prefill_flops(num_seqs: int, prefix: int, new: int, heads: dict) -> int:
    """Multiply-adds ×2 of QKᵀ and PV over the causal pairs: query i attends to prefix + i + 1 keys."""
    pairs = num_seqs * (new * prefix + new * (new + 1) // 2)
    return 4 * heads["num_q_heads"] * heads["head_dim"] * pairs


def bench_prefill(num_seqs: int, prefix: int, new: int, heads: dict, device: torch.device, *, iters: int) -> dict:
    """The unified kernel on ``num_seqs`` chunks of ``new`` tokens after ``prefix`` cached ones."""
    from kvrelay.kernels import triton_unified

    seq_len = prefix + new
    args = make_decode_inputs(num_seqs, seq_len, heads, device, seed=num_seqs * 7 + seq_len)
    gen = torch.Generator(device=device).manual_seed(seq_len)
    q = torch.randn(num_seqs * new, heads["num_q_heads"], heads["head_dim"], generator=gen, device=device,
                    dtype=args["q"].dtype)
    starts = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device=device)
    scale = heads["head_dim"] ** -0.5

    def run() -> torch.Tensor:
        return triton_unified.unified_attention(q, args["k_cache"], args["v_cache"], args["block_tables"],
                                                args["seq_lens"], starts, scale=scale)

    ms = time_cuda_ms(run, warmup=2, iters=iters)
    flops = prefill_flops(num_seqs, prefix, new, heads)
    return {"num_seqs": num_seqs, "prefix_tokens": prefix, "new_tokens": new, **heads, "flops": flops,
            "unified_ms": round(ms, 4), "tflops": round(flops / (ms / 1e3) / 1e12, 2)}


def matmul_tflops(device: torch.device, *, iters: int) -> float:
    """bf16 8192³ matmul rate in the same run: the dense ceiling a prefill kernel is measured against."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = time_cuda_ms(lambda: a @ b, warmup=3, iters=iters)
    return 2 * 8192**3 / (ms / 1e3) / 1e12


def run_kernel_bench(*, iters: int = 20, reference_iters: int = 3,
                     peak_tflops: float = H200_BF16_DENSE_TFLOPS) -> dict:
    """Benchmark paged decode attention on CUDA if present (else the reference on a tiny CPU shape).

    Returns a JSON-ready dict: machine label, ceilings (``hbm_peak_bytes_per_s`` from NVML,
    ``copy_bytes_per_s`` measured) and one row per shape with times in ms, bytes per second and the
    ratios ``frac_of_hbm_peak`` and ``frac_of_copy``: each call launched from Python (``triton_*``,
    ``unified_*``) and replayed from a CUDA graph (``*_graph_*``, as the engine's decode step runs).
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
        row["unified_frac_of_hbm_peak"] = round(row["unified_bytes_per_s"] / peak, 3) if peak else None
        for name in ("triton_graph", "unified_graph"):  # replayed from a CUDA graph, as the engine decodes
            row[f"{name}_frac_of_hbm_peak"] = round(row[f"{name}_bytes_per_s"] / peak, 3) if peak else None
            row[f"{name}_frac_of_copy"] = round(row[f"{name}_bytes_per_s"] / copy, 3)
        rows.append(row)
        torch.cuda.empty_cache()
    result["shapes"] = rows
    measured = matmul_tflops(device, iters=iters)
    result["bf16_matmul_tflops"] = round(measured, 1)
    result["bf16_peak_tflops"] = peak_tflops
    prefill = []
    for num_seqs, prefix, new in PREFILL_SHAPES:
        row = bench_prefill(num_seqs, prefix, new, CUDA_HEADS, device, iters=max(3, iters // 4))
        row["frac_of_matmul"] = round(row["tflops"] / measured, 3)
        row["frac_of_peak"] = round(row["tflops"] / peak_tflops, 3)
        prefill.append(row)
        torch.cuda.empty_cache()
    result["prefill"] = prefill
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench kernel", description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="timed calls of the Triton kernel per shape")
    p.add_argument("--reference-iters", type=int, default=3, help="timed calls of the reference per shape")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                   help="the GPU's dense bf16 peak (datasheet), for prefill's frac_of_peak")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    emit(run_kernel_bench(iters=a.iters, reference_iters=a.reference_iters, peak_tflops=a.peak_tflops), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
