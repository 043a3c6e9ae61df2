"""Timed NIXL READs of KV blocks between an owner and this process (the reader): the measuring core of
`kvrelay bench transfer` (same host) and ``--remote`` (two hosts, `benchmarks.transfer_remote`)."""

from __future__ import annotations

import asyncio
import ctypes
import random
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

KIB, MIB = 1024, 1024 * 1024
MADV_HUGEPAGE = 14


def spec_for(block_bytes: int) -> Any:
    from kvrelay.kvstore.block_spec import BlockSpec

    assert block_bytes % (64 * KIB) == 0
    # 8 kv heads × 16 tokens × 128 dims × fp16 × (k|v) = 64 KiB per layer.
    return BlockSpec(num_layers=block_bytes // (64 * KIB), num_kv_heads=8, head_dim=128, block_size_tokens=16,
                     dtype="float16", model_fingerprint="bench")


def new_pool(spec: Any, num_blocks: int, *, hugepages: bool, fill: int) -> torch.Tensor:
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


def owner_loop(conn: Connection) -> None:
    """Owner process: ("setup", block_bytes, num_blocks, hugepages) → encoded AgentMeta; ("exit",)."""
    from kvrelay.transfer.nixl_agent import KvAgent
    from kvrelay.transfer.wire import encode_meta

    agent = None
    while True:
        msg = conn.recv()
        if agent is not None and msg[0] in ("setup", "exit"):
            agent.close()
            agent = None
        if msg[0] == "exit":
            return
        _, block_bytes, num_blocks, hugepages = msg
        spec = spec_for(block_bytes)
        pool = new_pool(spec, num_blocks, hugepages=hugepages, fill=7)
        agent = KvAgent(f"bench-owner-{block_bytes}", spec, [("device", pool)])
        conn.send(encode_meta(agent.meta))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def timed_read(agent: Any, link: Any, remote: list[Any], local_ids: list[int]) -> float:
    from kvrelay.transfer.puller import POLL_MAX_S, POLL_MIN_S

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


def memcpy_blocks(dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]], block_bytes: int) -> float:
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    t0 = time.perf_counter()
    for d, s in pairs:
        ctypes.memmove(dst_base + d * block_bytes, src_base + s * block_bytes, block_bytes)
    return time.perf_counter() - t0


async def read_sweep(
    conn: Connection, configs: list[tuple[int, int]], *, pool_bytes: int, target_bytes: int, hugepages: bool,
    seed: int,
) -> list[dict[str, Any]]:
    """One row per (block bytes, blocks per transfer) in ``configs`` that fits the pool."""
    from kvrelay.kvstore.digest import DEFAULT_SAMPLE_RATE, IntegrityPolicy, digest_blocks
    from kvrelay.transfer.lease import TierBlock
    from kvrelay.transfer.nixl_agent import KvAgent
    from kvrelay.transfer.wire import decode_meta

    rng = random.Random(seed)
    sampled = IntegrityPolicy("sampled", DEFAULT_SAMPLE_RATE)
    rows: list[dict[str, Any]] = []
    for block_bytes in sorted({b for b, _ in configs}):
        num_blocks = max(1, pool_bytes // block_bytes)
        conn.send(("setup", block_bytes, num_blocks, hugepages))
        meta = decode_meta(conn.recv())
        spec = spec_for(block_bytes)
        pool = new_pool(spec, num_blocks, hugepages=hugepages, fill=1)  # touched outside the timings
        source = new_pool(spec, num_blocks, hugepages=hugepages, fill=2)
        agent = KvAgent(f"bench-reader-{block_bytes}", spec, [("device", pool)])
        try:
            link = await agent.add_peer(meta)
            for n in sorted(n for b, n in configs if b == block_bytes):
                if n > num_blocks:
                    continue
                num_xfers = max(5, min(200, target_bytes // (n * block_bytes)))
                read_s: list[float] = []
                copy_s: list[float] = []
                digest_s: list[float] = []
                sampled_s: list[float] = []
                for i in range(num_xfers + 2):  # two warm-up transfers
                    remote_ids = rng.sample(range(num_blocks), n)
                    local_ids = rng.sample(range(num_blocks), n)
                    t_read = await timed_read(agent, link, [TierBlock("device", b) for b in remote_ids], local_ids)
                    # What a pull adds with ``kvstore.integrity: all`` (the digest of every block it read) and
                    # with ``sampled`` (of the blocks `IntegrityPolicy.pick` picks), as `Puller._register` does.
                    seeds = [rng.getrandbits(64) for _ in local_ids]
                    t0 = time.perf_counter()
                    digest_blocks(pool, local_ids, seeds)
                    t1 = time.perf_counter()
                    picked = sampled.pick(len(local_ids), rng)
                    digest_blocks(pool, [local_ids[j] for j in picked], [seeds[j] for j in picked])
                    t_digest, t_sampled = t1 - t0, time.perf_counter() - t1
                    t_copy = memcpy_blocks(pool, source, list(zip(local_ids, remote_ids, strict=True)), block_bytes)
                    if i >= 2:
                        read_s.append(t_read)
                        copy_s.append(t_copy)
                        digest_s.append(t_digest)
                        sampled_s.append(t_sampled)
                nbytes = n * block_bytes
                read_gbps = nbytes * len(read_s) / sum(read_s) / 1e9
                copy_gbps = nbytes * len(copy_s) / sum(copy_s) / 1e9
                rows.append({
                    "block_bytes": block_bytes, "blocks_per_transfer": n, "transfers": len(read_s),
                    "read_gbps": round(read_gbps, 3), "memcpy_gbps": round(copy_gbps, 3),
                    "ratio_vs_memcpy": round(read_gbps / copy_gbps, 3),
                    "p50_ms": round(statistics.median(read_s) * 1e3, 4),
                    "p99_ms": round(percentile(read_s, 0.99) * 1e3, 4),
                    "memcpy_p50_ms": round(statistics.median(copy_s) * 1e3, 4),
                    "digest_gbps": round(nbytes * len(digest_s) / sum(digest_s) / 1e9, 3),
                    "digest_fraction_of_read": round(sum(digest_s) / sum(read_s), 4),
                    "sampled_digest_fraction_of_read": round(sum(sampled_s) / sum(read_s), 4),
                })
            await agent.remove_peer(link)
        finally:
            agent.close()
    return rows
