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
``copy_`` it replaces in the host tier.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import multiprocessing as mp
import os
import random
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.common import emit, machine_label

KIB, MIB = 1024, 1024 * 1024
MADV_HUGEPAGE = 14
BLOCK_SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB)
BLOCKS_PER_TRANSFER = (1, 4, 16, 64, 256, 1000)
TARGET = {"min_ratio": 0.7, "min_block_bytes": MIB, "min_blocks_per_transfer": 16}


def _spec(block_bytes: int) -> Any:
    from kvstore.block_spec import BlockSpec

    assert block_bytes % (64 * KIB) == 0
    # 8 kv heads × 16 tokens × 128 dims × fp16 × (k|v) = 64 KiB per layer.
    return BlockSpec(num_layers=block_bytes // (64 * KIB), num_kv_heads=8, head_dim=128, block_size_tokens=16,
                     dtype="float16", model_fingerprint="bench")


def _new_pool(spec: Any, num_blocks: int, *, hugepages: bool, fill: int) -> torch.Tensor:
    """A touched pool tensor, 2 MiB-aligned and advised onto transparent huge pages if asked."""
    nbytes = num_blocks * spec.block_bytes
    raw = torch.empty(nbytes + 2 * MIB, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % (2 * MIB)
    flat = raw[offset:offset + nbytes]
    if hugepages:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(flat.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    flat.fill_(fill)
    return flat.view(spec.torch_dtype).view(spec.pool_shape(num_blocks))


def _owner(conn: Connection) -> None:
    """Owner process: ("setup", block_bytes, num_blocks, hugepages) → encoded AgentMeta; ("exit",)."""
    from transfer.nixl_agent import KvAgent
    from transfer.wire import encode_meta

    agent = None
    while True:
        msg = conn.recv()
        if agent is not None and msg[0] in ("setup", "exit"):
            agent.close()
            agent = None
        if msg[0] == "exit":
            return
        _, block_bytes, num_blocks, hugepages = msg
        spec = _spec(block_bytes)
        pool = _new_pool(spec, num_blocks, hugepages=hugepages, fill=7)
        agent = KvAgent(f"bench-owner-{block_bytes}", spec, [("device", pool)])
        conn.send(encode_meta(agent.meta))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _timed_read(agent: Any, link: Any, remote: list[Any], local_ids: list[int]) -> float:
    from transfer.puller import POLL_MAX_S, POLL_MIN_S

    t0 = time.perf_counter()
    xfers = await agent.read(link, remote, "device", local_ids)
    interval = POLL_MIN_S
    while not all(x.finished for x in xfers):  # the same loop as Puller._wait
        await asyncio.sleep(interval)
        interval = min(interval * 2, POLL_MAX_S)
        await agent.poll(xfers)
    await agent.release(xfers)  # a pull releases and notifies in this same hop (KvAgent.complete)
    elapsed = time.perf_counter() - t0
    assert all(x.state == "DONE" for x in xfers), [x.error for x in xfers]
    return elapsed


def _memcpy_blocks(dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]], block_bytes: int) -> float:
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    t0 = time.perf_counter()
    for d, s in pairs:
        ctypes.memmove(dst_base + d * block_bytes, src_base + s * block_bytes, block_bytes)
    return time.perf_counter() - t0


async def _read_sweep(
    conn: Connection, configs: list[tuple[int, int]], *, pool_bytes: int, target_bytes: int, hugepages: bool,
    seed: int,
) -> list[dict[str, Any]]:
    """One row per (block bytes, blocks per transfer) in ``configs`` that fits the pool."""
    from transfer.lease import TierBlock
    from transfer.nixl_agent import KvAgent
    from transfer.wire import decode_meta

    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for block_bytes in sorted({b for b, _ in configs}):
        num_blocks = max(1, pool_bytes // block_bytes)
        conn.send(("setup", block_bytes, num_blocks, hugepages))
        meta = decode_meta(conn.recv())
        spec = _spec(block_bytes)
        pool = _new_pool(spec, num_blocks, hugepages=hugepages, fill=1)  # touched outside the timings
        source = _new_pool(spec, num_blocks, hugepages=hugepages, fill=2)
        agent = KvAgent(f"bench-reader-{block_bytes}", spec, [("device", pool)])
        try:
            link = await agent.add_peer(meta)
            for n in sorted(n for b, n in configs if b == block_bytes):
                if n > num_blocks:
                    continue
                num_xfers = max(5, min(200, target_bytes // (n * block_bytes)))
                read_s: list[float] = []
                copy_s: list[float] = []
                for i in range(num_xfers + 2):  # two warm-up transfers
                    remote_ids = rng.sample(range(num_blocks), n)
                    local_ids = rng.sample(range(num_blocks), n)
                    t_read = await _timed_read(agent, link, [TierBlock("device", b) for b in remote_ids], local_ids)
                    t_copy = _memcpy_blocks(pool, source, list(zip(local_ids, remote_ids, strict=True)), block_bytes)
                    if i >= 2:
                        read_s.append(t_read)
                        copy_s.append(t_copy)
                nbytes = n * block_bytes
                read_gbps = nbytes * len(read_s) / sum(read_s) / 1e9
                copy_gbps = nbytes * len(copy_s) / sum(copy_s) / 1e9
                rows.append({
                    "block_bytes": block_bytes, "blocks_per_transfer": n, "transfers": len(read_s),
                    "read_gbps": round(read_gbps, 3), "memcpy_gbps": round(copy_gbps, 3),
                    "ratio_vs_memcpy": round(read_gbps / copy_gbps, 3),
                    "p50_ms": round(statistics.median(read_s) * 1e3, 4),
                    "p99_ms": round(_percentile(read_s, 0.99) * 1e3, 4),
                    "memcpy_p50_ms": round(statistics.median(copy_s) * 1e3, 4),
                })
            await agent.remove_peer(link)
        finally:
            agent.close()
    return rows


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
    from transfer.nixl_agent import KvAgent

    rng = random.Random(seed)
    rows = []
    for block_bytes in (256 * KIB, 2 * MIB):
        spec = _spec(block_bytes)
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
    owner = ctx.Process(target=_owner, args=(child,), daemon=True)
    owner.start()
    every = [(b, n) for b in BLOCK_SIZES for n in BLOCKS_PER_TRANSFER]
    judged = [(b, n) for b, n in every if b >= TARGET["min_block_bytes"] and n >= TARGET["min_blocks_per_transfer"]]
    sizes = {"pool_bytes": pool_mib * MIB, "target_bytes": target_mib * MIB, "seed": seed}
    try:
        rows = asyncio.run(_read_sweep(parent, every, hugepages=False, **sizes))
        rows_thp = asyncio.run(_read_sweep(parent, judged, hugepages=True, **sizes))
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
    a = p.parse_args(argv)
    result = run(pool_mib=a.pool_mib, target_mib=a.target_mib, seed=a.seed)
    emit(result, a.out)
    if a.plot:
        _plot(result, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
