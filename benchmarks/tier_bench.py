"""``kvrelay bench tiers``: the tiered KV store against the limits measured in the same run.

1. ``copies`` — device→host demotion (eviction at allocation time, and the watermark pre-copy) and
   host→device promotion (`TieredStore.load`), each vs one ``torch`` copy of the same bytes between the
   same kinds of memory. Blocks of 2 MiB (fp16, 32 layers, 8 KV heads, 16 tokens, head dim 128).
2. ``lmdb`` — `LmdbTier` write (put + flush, i.e. committed and fsynced) and read (`get_into`, header and
   checksum verified) of 2 MiB blocks vs sequential write+fsync / read of the same bytes to a plain file
   in the same directory; reads with a cold page cache (``posix_fadvise(DONTNEED)`` after fsync, the
   environment reopened) and warm, reported separately. Also the checksum algorithms' speeds.
3. ``trace`` — the Mooncake conversation trace replayed against the store alone (no model): each
   512-token trace block becomes one KV block whose key is the block-key chain over 4 synthetic tokens
   per hash id (same hash id → same tokens); the first ``--requests`` requests, back to back (no timing);
   each request: match_prefix → load → allocate and register the missed blocks → release →
   maintain_watermark. Block hit rate per tier and in total vs an offline LRU cache whose capacity is
   the sum of the three tiers' capacities, on the same key sequence (a request's blocks are touched
   tail first, so its head is most recent — the order `BlockPool.release` gives).

Every figure is printed with its baseline and their ratio, as JSON.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from kvrelay.benchmarks.common import emit, machine_label, read_trace
from kvrelay.kvstore.block_key import BlockKey, block_keys
from kvrelay.kvstore.block_record import CHECKSUM_ID_TO_ALGO, entry_bytes, record_bytes
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.lmdb_tier import LmdbTier
from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig

BIG_SPEC = BlockSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size_tokens=16, dtype="float16")  # 2 MiB
TRACE_SPEC = BlockSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size_tokens=4)  # 2 KiB
TOKENS_PER_TRACE_BLOCK = TRACE_SPEC.block_size_tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn: Callable[[], None], reps: int, device: torch.device, setup: Callable[[], None] | None = None) -> float:
    best = float("inf")
    for _ in range(reps):
        if setup is not None:
            setup()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _figure(num_bytes: int, subject_s: float, baseline_s: float) -> dict[str, float]:
    subject, baseline = num_bytes / subject_s / 1e9, num_bytes / baseline_s / 1e9
    return {"gb_per_s": round(subject, 3), "baseline_gb_per_s": round(baseline, 3),
            "ratio": round(subject / baseline, 3)}


def _keys(spec: BlockSpec, n: int, salt: bytes = b"") -> list[BlockKey]:
    tokens = list(range(n * spec.block_size_tokens))
    return block_keys(tokens, block_size_tokens=spec.block_size_tokens, spec_fingerprint=spec.fingerprint, salt=salt)


# -------------------------------------------------------------------- copies
def _baseline_copy_s(dst: torch.Tensor, src: torch.Tensor, reps: int, device: torch.device) -> tuple[float, float]:
    """Seconds for one ``torch`` copy of the whole pool (all intra-op threads) and, CPU to CPU, for one
    single-threaded memcpy of it (numpy; the store copies CPU blocks that way). Each best of ``reps``."""
    torch_s = _best_s(lambda: dst.copy_(src, non_blocking=dst.is_pinned() or src.is_pinned()), reps, device)
    if dst.device.type != "cpu" or src.device.type != "cpu":
        return torch_s, torch_s
    d, s = dst.view(-1).view(torch.uint8).numpy(), src.view(-1).view(torch.uint8).numpy()
    return torch_s, _best_s(lambda: np.copyto(d, s), reps, device)


def _copy_figure(num_bytes: int, subject_s: float, baselines_s: tuple[float, float]) -> dict[str, float]:
    fig = _figure(num_bytes, subject_s, baselines_s[0])
    one_thread = num_bytes / baselines_s[1] / 1e9
    fig.update(memcpy_1thread_gb_per_s=round(one_thread, 3), ratio_to_1thread=round(fig["gb_per_s"] / one_thread, 3))
    return fig


def bench_copies(device: torch.device, num_blocks: int, reps: int) -> dict[str, object]:
    spec = BIG_SPEC
    store = TieredStore(spec, TieredStoreConfig(num_device_blocks=num_blocks, num_host_blocks=num_blocks,
                                                watermark_blocks=0, device=str(device)))
    store.device_pool.view(torch.int16).random_()
    keys = _keys(spec, num_blocks)
    host_copy = torch.empty_like(store.host.pool)  # the baseline's destination: same kind, pre-touched
    host_copy.zero_()
    nbytes = num_blocks * spec.block_bytes

    def cache_all() -> None:  # every device block keyed and cached, host empty
        for key in list(store.host.keys_lru_first()):
            store.host.discard(key)
        ids = [store.block_pool.block_id_of(k) for k in keys]
        if any(b is None for b in ids):
            ids = store.block_pool.allocate(num_blocks)
            for b, k in zip(ids, keys):
                store.block_pool.register_key(b, k)
        else:
            store.block_pool.acquire(ids)
        store.block_pool.release(ids)

    evicted: list[list[int]] = []

    def demote() -> None:
        evicted.append(store.block_pool.allocate(num_blocks))

    demote_s = _best_s(demote, reps, device, setup=lambda: (evicted and store.block_pool.release(evicted.pop()),
                                                             cache_all()))
    store.block_pool.release(evicted.pop())
    loaded: list[list[int]] = []

    def promote() -> None:
        loaded.append(store.load(keys, store.match_prefix(keys)))

    def setup_promote() -> None:
        if loaded:
            store.block_pool.release(loaded.pop())
        cache_all()
        store.block_pool.release(store.block_pool.allocate(num_blocks))  # all to host, device free

    promote_s = _best_s(promote, reps, device, setup=setup_promote)
    assert len(loaded[-1]) == num_blocks
    store.block_pool.release(loaded.pop())
    store.watermark_blocks = num_blocks

    def setup_precopy() -> None:
        cache_all()

    precopy_s = _best_s(lambda: store.maintain_watermark(), reps, device, setup=setup_precopy)
    d2h_s = _baseline_copy_s(host_copy, store.device_pool, reps, device)
    h2d_s = _baseline_copy_s(store.device_pool, host_copy, reps, device)
    store.check_integrity()
    return {
        "device": str(device), "block_bytes": spec.block_bytes, "num_blocks": num_blocks,
        "host_pinned": store.host.pinned,
        "baseline": "one torch copy of the whole pool (all intra-op threads); also a 1-thread memcpy",
        "demote_on_eviction": _copy_figure(nbytes, demote_s, d2h_s),
        "demote_watermark_precopy": _copy_figure(nbytes, precopy_s, d2h_s),
        "promote_load": _copy_figure(nbytes, promote_s, h2d_s),
    }


# ---------------------------------------------------------------------- lmdb
def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_lmdb(work_dir: Path, num_blocks: int, reps: int) -> dict[str, object]:
    spec = BIG_SPEC
    values = [torch.randint(-30000, 30000, spec.block_shape, dtype=torch.int16).view(torch.float16) for _ in range(8)]
    keys = _keys(spec, num_blocks, salt=b"lmdb-bench")
    nbytes = num_blocks * spec.block_bytes
    record_disk = entry_bytes(record_bytes(spec.block_bytes, 4096), 4096)
    # A disk tier is much larger than one burst of writes; the map is address space, the file grows as used.
    capacity = max(4 << 30, int(num_blocks * record_disk / 0.8))
    plain = work_dir / "plain.bin"
    cpu = torch.device("cpu")
    dst = torch.empty(spec.block_shape, dtype=spec.torch_dtype)
    dst_bytes = dst.view(-1).view(torch.uint8).numpy()

    def new_tier() -> LmdbTier:
        return LmdbTier(spec, work_dir / "lmdb", capacity_bytes=capacity)

    tiers: list[LmdbTier] = []

    def fresh_env() -> None:
        while tiers:
            tiers.pop().close()
        for name in ("data.mdb", "lock.mdb"):
            (work_dir / "lmdb" / name).unlink(missing_ok=True)
        tiers.append(new_tier())

    def lmdb_write() -> None:
        for i, key in enumerate(keys):
            assert tiers[0].put(key, values[i % len(values)])
        tiers[0].flush(timeout_s=600)

    def file_write() -> None:
        with open(plain, "wb", buffering=0) as f:
            for i in range(num_blocks):
                f.write(values[i % len(values)].view(-1).view(torch.uint8).numpy().data)
            os.fsync(f.fileno())

    def lmdb_read() -> None:
        for key in keys:
            assert tiers[0].get_into(key, dst)

    def file_read() -> None:
        with open(plain, "rb", buffering=0) as f:
            for _ in range(num_blocks):
                assert f.readinto(dst_bytes) == spec.block_bytes

    def cold_lmdb() -> None:
        tiers.pop().close()
        _drop_cache(work_dir / "lmdb" / "data.mdb")
        tiers.append(new_tier())

    # Subject and baseline alternate, best of ``reps`` each: the disk's speed drifts between runs.
    write_s = file_write_s = cold_s = file_cold_s = warm_s = file_warm_s = float("inf")
    for _ in range(reps):
        write_s = min(write_s, _best_s(lmdb_write, 1, cpu, setup=fresh_env))
        file_write_s = min(file_write_s, _best_s(file_write, 1, cpu, setup=lambda: plain.unlink(missing_ok=True)))
    for _ in range(reps):
        cold_s = min(cold_s, _best_s(lmdb_read, 1, cpu, setup=cold_lmdb))
        file_cold_s = min(file_cold_s, _best_s(file_read, 1, cpu, setup=lambda: _drop_cache(plain)))
    for _ in range(reps):
        warm_s = min(warm_s, _best_s(lmdb_read, 1, cpu))
        file_warm_s = min(file_warm_s, _best_s(file_read, 1, cpu))
    tiers[0].check_integrity()
    stats = tiers[0].disk_stats()
    tiers.pop().close()
    plain.unlink()
    payload = memoryview(values[0].view(-1).view(torch.uint8).numpy().tobytes())
    head = memoryview(bytes(88))
    checksum_gb_s = {
        name: round(spec.block_bytes * 20 / _best_s(lambda fn=fn: [fn(head, payload) for _ in range(20)], 3, cpu) / 1e9,
                    3)
        for name, fn in (algo for algo in CHECKSUM_ID_TO_ALGO.values())
    }
    return {
        "block_bytes": spec.block_bytes, "num_blocks": num_blocks, "dir": str(work_dir),
        "cold_cache_method": "fsync + posix_fadvise(POSIX_FADV_DONTNEED); LMDB environment closed and reopened",
        "write": _figure(nbytes, write_s, file_write_s),
        "read_cold": _figure(nbytes, cold_s, file_cold_s),
        "read_warm": _figure(nbytes, warm_s, file_warm_s),
        "checksum_gb_per_s": checksum_gb_s,
        "checksum_used": "pagesum",
        "dropped_writes": stats.num_dropped,
    }


# --------------------------------------------------------------------- trace
def _trace_keys(hash_ids: tuple[int, ...]) -> list[BlockKey]:
    tokens = [h * TOKENS_PER_TRACE_BLOCK + j for h in hash_ids for j in range(TOKENS_PER_TRACE_BLOCK)]
    return block_keys(tokens, block_size_tokens=TRACE_SPEC.block_size_tokens, spec_fingerprint=TRACE_SPEC.fingerprint)


def offline_lru_hits(requests: list[list[BlockKey]], capacity_blocks: int) -> int:
    """Blocks of the longest cached prefix of each request, for one LRU cache of ``capacity_blocks``."""
    cache: OrderedDict[BlockKey, None] = OrderedDict()
    hits = 0
    for keys in requests:
        for key in keys:
            if key not in cache:
                break
            hits += 1
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits


def bench_trace(work_dir: Path, num_requests: int, sizes: tuple[int, int, int]) -> dict[str, object]:
    device_blocks, host_blocks, disk_blocks = sizes
    page = 4096
    record_disk = entry_bytes(record_bytes(TRACE_SPEC.block_bytes, page), page)
    disk_bytes = int(disk_blocks * record_disk / 0.9) + 65 * page  # high watermark 0.9 of (map - 64 pages)
    store = TieredStore(TRACE_SPEC, TieredStoreConfig(
        num_device_blocks=device_blocks, num_host_blocks=host_blocks, disk_path=str(work_dir / "trace-kv"),
        disk_capacity_bytes=disk_bytes, admit="all",
    ))
    requests = [_trace_keys(r.hash_ids) for r in read_trace(limit=num_requests)]
    t0 = time.perf_counter()
    for keys in requests:
        hit = store.load(keys, store.match_prefix(keys))
        new = store.block_pool.allocate(len(keys) - len(hit))
        for block_id, key in zip(new, keys[len(hit):]):
            store.block_pool.register_key(block_id, key)
        store.block_pool.release(hit + new)
        store.maintain_watermark()
    store.flush(timeout_s=300)
    replay_s = time.perf_counter() - t0
    store.check_integrity()
    stats = store.stats()
    capacity = device_blocks + host_blocks + store.disk.capacity_blocks
    store.close()
    queried = sum(len(k) for k in requests)
    lru = offline_lru_hits(requests, capacity) / queried
    per_tier = {t: round(n / queried, 4) for t, n in stats.tier_to_hits.items()}
    total = sum(stats.tier_to_hits.values()) / queried
    return {
        "scaling": {
            "trace_block": f"512 tokens → 1 KV block of {TOKENS_PER_TRACE_BLOCK} synthetic tokens "
                           f"({TRACE_SPEC.block_bytes} bytes), key = block-key chain over the hash ids",
            "request_window": f"first {len(requests)} requests, replayed back to back (no time axis)",
            "capacity_blocks": {"device": device_blocks, "host": host_blocks, "disk": store.disk.capacity_blocks,
                                "total": capacity},
        },
        "queried_blocks": queried,
        "hit_rate_by_tier": per_tier,
        "hit_rate_total": round(total, 4),
        "offline_lru_hit_rate": round(lru, 4),
        "ratio_to_offline_lru": round(total / lru, 3) if lru else None,
        "disk_dropped_writes": stats.disk.num_dropped if stats.disk else 0,
        "replay_s": round(replay_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench tiers", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--dir", help="work directory for LMDB and the plain file (default: a new temp dir)")
    p.add_argument("--copy-blocks", type=int, default=64, help="2 MiB blocks per copy measurement")
    p.add_argument("--lmdb-blocks", type=int, default=96, help="2 MiB blocks written and read")
    p.add_argument("--requests", type=int, default=3000, help="trace requests replayed")
    p.add_argument("--tier-blocks", default="512,2048,8192", help="device,host,disk capacities in blocks")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: copies,lmdb,trace")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict[str, object] = {"bench": "tiers", **machine_label()}
    with tempfile.TemporaryDirectory(prefix="kvrelay-tier-bench-", dir=args.dir) as tmp:
        work = Path(tmp)
        if "copies" not in skip:
            result["copies"] = bench_copies(device, args.copy_blocks, args.reps)
        if "lmdb" not in skip:
            result["lmdb"] = bench_lmdb(work, args.lmdb_blocks, args.reps)
        if "trace" not in skip:
            sizes = tuple(int(x) for x in args.tier_blocks.split(","))
            assert len(sizes) == 3, "--tier-blocks needs device,host,disk"
            result["trace"] = bench_trace(work, args.requests, sizes)  # type: ignore[arg-type]
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
