"""Launch-parameter sweep of the split-K paged decode kernel (`kernels.triton_attention`) on a GPU.

For each shape (batch, context; Llama-3.1-8B's heads: 32 query, 8 KV, head_dim 128, bf16, 16-token blocks,
shuffled block tables) it times stage 1 + stage 2 launched directly (no argument checks, scratch allocated
once) for every combination of tile tokens, warps, pipeline stages and split count, checks each result
against `kernels.reference.paged_decode_attention`, and prints the share of a device-to-device copy's
bandwidth (bytes read + written) measured in the same run. A measurement tool for choosing defaults, not
used by the engine.

    python -m benchmarks.decode_tune [--out tune.json] [--shapes 8x8192,64x8192,4x32768]

Raises SystemExit without CUDA.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
from kvrelay.benchmarks.kernel_bench import copy_bytes_per_s, decode_bytes, make_decode_inputs
from kvrelay.kernels import reference

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size_tokens=16, dtype="bfloat16")
TILES = (32, 64, 128)
WARPS = (4, 8)
STAGES = (1, 2, 3, 4)
SPLIT_FACTORS = (0.5, 1, 2)  # of the default split count (`decode_num_splits`)


def sweep_shape(batch: int, seq_len: int, copy_bps: float) -> list[dict]:
    import triton
    import triton.testing
    from kvrelay.kernels import triton_attention as ta

    device = torch.device("cuda")
    args = make_decode_inputs(batch, seq_len, HEADS, device, seed=batch * 7 + seq_len)
    q, k_cache, v_cache = args["q"], args["k_cache"], args["v_cache"]
    tables, lens = args["block_tables"], args["seq_lens"]
    scale = HEADS["head_dim"] ** -0.5
    want = reference.paged_decode_attention(**args, scale=scale).float()
    num_bytes = decode_bytes(batch, seq_len, HEADS)
    n, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    max_tokens = tables.shape[1] * bs
    default_splits = ta.decode_num_splits(max_tokens)
    # As the launcher: the interpreter (a CPU dry run) multiplies bf16 as raw integers in tl.dot.
    interpreted = isinstance(ta._decode_split_kernel, ta.InterpretedFunction)
    dot_dtype = ta.tl.float32 if interpreted else ta.TORCH_TO_TL_DTYPE[q.dtype]
    def launch(tile: int, warps: int, stages: int, splits: int, part_max: torch.Tensor,
           part_sum: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor) -> None:
        ta._decode_split_kernel[(n, hkv, splits)](
            q, k_cache, v_cache, tables, lens, part_max, part_sum, part_acc, part_max,
            scale * ta.LOG2E, tables.shape[1], max_tokens, 0,
            *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], tables.stride(0),
            GROUP=hq // hkv, GROUP_PAD=max(ta.MIN_DOT_DIM, triton.next_power_of_2(hq // hkv)),
            HEAD_DIM=d, DIM_PAD=triton.next_power_of_2(d), BLOCK_SIZE=bs, TILE=tile,
            DOT_DTYPE=dot_dtype, STORE_LOGITS=False, HAS_WINDOW=False,
            num_warps=warps, num_stages=stages)
        ta._reduce_splits_kernel[(n, hq)](
            part_max, part_sum, part_acc, out, part_max, part_max, *out.stride()[:2],
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=d,
            DIM_PAD=triton.next_power_of_2(d), STORE_LSE=False, HAS_SINKS=False)

    rows = []
    for tile, warps, stages, factor in itertools.product(TILES, WARPS, STAGES, SPLIT_FACTORS):
        splits = max(1, int(default_splits * factor))
        part_max = torch.empty((n, hq, splits), dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((n, hq, splits, d), dtype=torch.float32, device=device)
        out = torch.full((n, hq, d), float("nan"), dtype=q.dtype, device=device)

        run = functools.partial(launch, tile, warps, stages, splits, part_max, part_sum, part_acc, out)

        row = dict(batch=batch, seq_len=seq_len, tile=tile, warps=warps, stages=stages, splits=splits,
                   default=(tile == ta.MIN_TILE_TOKENS and factor == 1 and warps == 4 and stages == 3))
        try:
            run()
            torch.cuda.synchronize()
            err = (out.float() - want).abs().max().item()
            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # a configuration that does not compile (shared memory) is reported, not fatal
            row.update(error=f"{type(exc).__name__}: {str(exc)[:120]}")
            rows.append(row)
            continue
        row.update(max_abs_err=err, ms=round(ms, 4), frac_of_copy=round(num_bytes / (ms / 1e3) / copy_bps, 3))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x8192,64x8192,4x32768,32x1024")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_tune needs a CUDA device")
    copy_bps = copy_bytes_per_s(torch.device("cuda"), warmup=3, iters=10)
    result: dict = {"copy_bytes_per_s": copy_bps, "heads": HEADS, "rows": []}
    for shape in ns.shapes.split(","):
        batch, seq_len = (int(x) for x in shape.split("x"))
        rows = sweep_shape(batch, seq_len, copy_bps)
        result["rows"].extend(rows)
        ok = [r for r in rows if "ms" in r and r["max_abs_err"] < 2e-2]
        best = max(ok, key=lambda r: r["frac_of_copy"]) if ok else None
        default = next((r for r in ok if r["default"]), None)
        print(f"{batch}x{seq_len}: default {default and default['frac_of_copy']} of copy "
              f"({default and default['ms']} ms); best {best and best['frac_of_copy']} "
              f"(tile {best and best['tile']}, warps {best and best['warps']}, stages {best and best['stages']}, "
              f"splits {best and best['splits']}, {best and best['ms']} ms); "
              f"{len(rows) - len(ok)} failed or inexact", flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
