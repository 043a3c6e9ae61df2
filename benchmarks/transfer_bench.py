"""``kvrelay bench transfer``: cross-process NIXL READ of KV blocks, and loopback demotion, vs memcpy.

An owner process (multiprocessing spawn) registers a pool of ``--pool-mib`` MiB per block size with a
real `KvAgent`; this process (the reader) loads its metadata and READs blocks through the same path a
pull takes (prepared per-block descriptor lists, `KvAgent.read`, polling from asyncio with the
`Puller`'s backoff). Block ids are shuffled on both sides so NIXL cannot merge descriptors.

Per (block size, blocks per transfer): READ throughput and per-transfer latency p50/p99, against a
single-thread ``memcpy`` (``ctypes.memmove``) of the same blocks, measured in the same run (the
machine is noisy: only the ratio is meaningful). ``read`` uses pools as the engine allocates them (4 KiB
pages); ``read_thp`` repeats the configurations the target judges with pools on transparent huge pages
(UCX moves same-host bytes with CMA, ``process_vm_readv``, whose cost is per page pinned).
``descriptor_scaling`` fits time = fixed + n·per_desc for the smallest block size.
``loopback_demotion`` compares `KvAgent.local_copy` (device → host through NIXL) with the per-block
``copy_`` it replaces in the host tier. ``digest_fraction_of_read``: the time to digest the blocks a READ
landed (what ``kvstore.integrity: all`` adds to a pull, `kvstore.digest`) over the READ's own time, same
run, and ``sampled_digest_fraction_of_read`` the same for ``sampled`` at the default rate; ``integrity``
reports the largest of each over the judged configurations (goal <= 0.05).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any

import torch
from kvrelay.benchmarks.common import emit, machine_label
from kvrelay.benchmarks.transfer_read import KIB, MIB, owner_loop, read_sweep, spec_for

BLOCK_SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB)
BLOCKS_PER_TRANSFER = (1, 4, 16, 64, 256, 1000)
TARGET = {"min_ratio": 0.7, "min_block_bytes": MIB, "min_blocks_per_transfer": 16}
INTEGRITY_GOAL = 0.05  # digest time / READ time with kvstore.integrity: all


def _integrity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    judged = [r for r in rows if r["block_bytes"] >= TARGET["min_block_bytes"]
              and r["blocks_per_transfer"] >= TARGET["min_blocks_per_transfer"]]
    from kvrelay.kvstore.digest import DEFAULT_SAMPLE_RATE

    every = max((r["digest_fraction_of_read"] for r in rows), default=None)
    worst = max((r["digest_fraction_of_read"] for r in judged), default=None)
    sampled = max((r["sampled_digest_fraction_of_read"] for r in judged), default=None)
    return {"max_fraction_goal": INTEGRITY_GOAL, "max_fraction_judged": worst, "max_fraction_any": every,
            "met": worst is not None and worst <= INTEGRITY_GOAL, "sample_rate": DEFAULT_SAMPLE_RATE,
            "sampled_max_fraction_judged": sampled,
            "sampled_met": sampled is not None and sampled <= INTEGRITY_GOAL}


def _min_judged_ratio(rows: list[dict[str, Any]]) -> float | None:
    judged = [r["ratio_vs_memcpy"] for r in rows if r["block_bytes"] >= TARGET["min_block_bytes"]
              and r["blocks_per_transfer"] >= TARGET["min_blocks_per_transfer"]]
    return min(judged, default=None)


def _descriptor_scaling(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Least-squares fit of p50 time against the descriptor count, for the smallest block size."""
    block_bytes = min(r["block_bytes"] for r in rows)
    points = [(r["blocks_per_transfer"], r["p50_ms"]) for r in rows if r["block_bytes"] == block_bytes]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return {
        "block_bytes": block_bytes, "points": [{"descriptors": x, "p50_ms": y} for x, y in points],
        "per_descriptor_us": round(slope * 1e3, 3), "fixed_us": round((mean_y - slope * mean_x) * 1e3, 1),
    }


def _loopback_demotion(*, num_blocks: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    from kvrelay.transfer.nixl_agent import KvAgent

    rng = random.Random(seed)
    rows = []
    for block_bytes in (256 * KIB, 2 * MIB):
        spec = spec_for(block_bytes)
        device, host = spec.new_pool(num_blocks), spec.new_pool(num_blocks)
        device.fill_(3)
        host.fill_(0)
        agent = KvAgent(f"bench-loop-{block_bytes}", spec, [("device", device), ("host", host)])
        try:
            n = num_blocks // 2
            nixl_s, torch_s = [], []
            for i in range(repeats + 1):
                src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
                t0 = time.perf_counter()
                assert agent.local_copy("device", src, "host", dst) == "nixl"
                t1 = time.perf_counter()
                for s, d in zip(src, dst, strict=True):  # what HostTier.put does per block
                    host[d].copy_(device[s])
                t2 = time.perf_counter()
                if i:
                    nixl_s.append(t1 - t0)
                    torch_s.append(t2 - t1)
        finally:
            agent.close()
        nbytes = n * block_bytes
        nixl_gbps = nbytes * len(nixl_s) / sum(nixl_s) / 1e9
        torch_gbps = nbytes * len(torch_s) / sum(torch_s) / 1e9
        rows.append({"block_bytes": block_bytes, "blocks_per_copy": n, "nixl_loopback_gbps": round(nixl_gbps, 3),
                     "torch_copy_gbps": round(torch_gbps, 3), "ratio_vs_torch": round(nixl_gbps / torch_gbps, 3)})
    return rows


def run(*, pool_mib: int, target_mib: int, seed: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # the memcpy and torch-copy baselines are single-threaded
    load_at_start = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=owner_loop, args=(child,), daemon=True)
    owner.start()
    every = [(b, n) for b in BLOCK_SIZES for n in BLOCKS_PER_TRANSFER]
    judged = [(b, n) for b, n in every if b >= TARGET["min_block_bytes"] and n >= TARGET["min_blocks_per_transfer"]]
    sizes = {"pool_bytes": pool_mib * MIB, "target_bytes": target_mib * MIB, "seed": seed}
    try:
        rows = asyncio.run(read_sweep(parent, every, hugepages=False, **sizes))
        rows_thp = asyncio.run(read_sweep(parent, judged, hugepages=True, **sizes))
        parent.send(("exit",))
        owner.join(timeout=30)
    finally:
        if owner.is_alive():
            owner.kill()
    return {
        "bench": "transfer", **machine_label(),
        "setup": {"pool_mib_per_block_size": pool_mib, "bytes_per_config_mib": target_mib, "backend": "UCX",
                  "memcpy": "single-thread ctypes.memmove of the same blocks, same run",
                  "load_avg_1m": [round(load_at_start, 2), round(os.getloadavg()[0], 2)]},
        "read": rows,
        "read_thp": rows_thp,
        "target": {**TARGET, "min_ratio_measured": _min_judged_ratio(rows),
                   "min_ratio_measured_thp": _min_judged_ratio(rows_thp)},
        "integrity": _integrity(rows),
        "descriptor_scaling": _descriptor_scaling(rows),
        "loopback_demotion": _loopback_demotion(num_blocks=max(8, min(128, pool_mib // 4)), repeats=5, seed=seed),
    }


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for block_bytes in sorted({r["block_bytes"] for r in result["read"]}):
        rows = [r for r in result["read"] if r["block_bytes"] == block_bytes]
        ax.plot([r["blocks_per_transfer"] for r in rows], [r["ratio_vs_memcpy"] for r in rows], marker="o",
                label=f"{block_bytes // KIB} KiB blocks")
    ax.axhline(TARGET["min_ratio"], color="grey", linestyle="--", label="target")
    ax.set(xscale="log", xlabel="blocks per READ", ylabel="NIXL READ / memcpy throughput",
           title="Cross-process READ vs single-thread memcpy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench transfer", description=__doc__.splitlines()[0])
    p.add_argument("--pool-mib", type=int, default=256, help="owner and reader pool size per block size")
    p.add_argument("--target-mib", type=int, default=256, help="bytes moved per configuration (bounds the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of READ/memcpy ratios here")
    p.add_argument("--remote", action="store_true",
                   help="READ between two network namespaces over UCX's TCP transport, against a raw TCP stream "
                        "between them (needs root; see benchmarks.transfer_remote)")
    a = p.parse_args(argv)
    if a.remote:
        from kvrelay.benchmarks.transfer_remote import run_remote

        emit(run_remote(pool_mib=a.pool_mib, target_mib=a.target_mib, seed=a.seed), a.out)
        return 0
    result = run(pool_mib=a.pool_mib, target_mib=a.target_mib, seed=a.seed)
    emit(result, a.out)
    if a.plot:
        _plot(result, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
