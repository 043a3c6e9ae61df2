"""``kvrelay store stats|clear --config FILE``: look at or empty the tiered KV store from outside.

The device and host tiers live in the serving process's memory, so from here only their configured
sizes are known; the disk tier is read directly (read-only, safe while a server runs). Hits per tier
and queries are the lifetime counters a serving process persists in the disk tier (absent without one).
Every engine node keeps its own disk tier (``disk.path/<node>``), so both commands work per node:
all the config's nodes by default, or ``--node NAME``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from deploy.config import Config, KvStoreConfig, for_node, load_config, node_names
from deploy.sizes import ConfigError
from kvstore.lmdb_env import OwnerLock, read_snapshot

TIERS_TO_CLEAR = ("all", "disk")


class StoreBusyError(RuntimeError):
    """The disk tier is owned by a running process."""


def _kvstore(config: Config) -> KvStoreConfig:
    return config.kvstore


def _moved_aside(path: Path) -> list[str]:
    return sorted(str(p) for p in path.parent.glob(f"{path.name}.corrupt-*"))


def store_stats(config: Config) -> dict[str, Any]:
    """Blocks, bytes and hits per tier, and the LMDB size and free space, as a JSON-able dict.

    Raises:
        ConfigError: no ``kvstore`` section.
        lmdb.Error: the disk tier exists but cannot be read.
    """
    kv = _kvstore(config)
    snap = read_snapshot(Path(kv.disk.path)) if kv.disk is not None else None
    block_bytes = snap.block_bytes if snap is not None and snap.block_bytes else None

    def blocks(size_bytes: int | None) -> int | None:
        return size_bytes // block_bytes if size_bytes is not None and block_bytes else None

    counters = snap.counters if snap is not None else {}
    tiers: dict[str, Any] = {
        "device": {
            "configured_bytes": kv.device.size_bytes, "fraction_of_free": kv.device.free_memory_frac,
            "capacity_blocks": blocks(kv.device.size_bytes), "hits": counters.get("hits.device"),
        },
        "host": None if kv.host is None else {
            "configured_bytes": kv.host.size_bytes, "capacity_blocks": blocks(kv.host.size_bytes),
            "hits": counters.get("hits.host"),
        },
        "disk": None,
    }
    if kv.disk is not None:
        disk: dict[str, Any] = {"path": kv.disk.path, "configured_bytes": kv.disk.size_bytes, "admit": kv.disk.admit,
                                "moved_aside": _moved_aside(Path(kv.disk.path))}
        if snap is not None:
            disk.update(
                num_blocks=snap.num_blocks, used_bytes=snap.used_bytes, lmdb_map_bytes=snap.map_bytes,
                lmdb_file_bytes=snap.file_bytes, free_bytes=max(0, kv.disk.size_bytes - snap.used_bytes),
                hits=counters.get("hits.disk"), corrupt=counters.get("disk.corrupt", 0),
                evicted=counters.get("disk.evicted", 0), dropped_writes=counters.get("disk.dropped", 0),
            )
        else:
            disk.update(num_blocks=0, used_bytes=0, free_bytes=kv.disk.size_bytes)
        tiers["disk"] = disk
    return {
        "block_size_tokens": kv.block_size_tokens,
        "block_bytes": block_bytes,
        "queries": counters.get("queries"),
        "tiers": tiers,
    }


def store_clear(config: Config, tier: str = "all") -> list[str]:
    """Delete the disk tier (its LMDB environment and any moved-aside copies). Returns what was removed.

    ``tier``: ``"all"`` or ``"disk"`` — the same thing, since only the disk tier outlives its process.

    Raises:
        ConfigError: no ``kvstore`` section or an unknown ``tier``.
        StoreBusyError: a running process owns the disk tier.
    """
    if tier not in TIERS_TO_CLEAR:
        raise ConfigError(f"--tier: {tier!r} is not one of {', '.join(TIERS_TO_CLEAR)}")
    kv = _kvstore(config)
    if kv.disk is None:
        return []
    path = Path(kv.disk.path)
    try:
        lock = OwnerLock(path)
    except RuntimeError as exc:
        raise StoreBusyError(str(exc)) from None
    try:
        removed = [p for p in [str(path)] + _moved_aside(path) if Path(p).exists()]
        for p in removed:
            shutil.rmtree(p)
        return removed
    finally:
        lock.release()


# ------------------------------------------------------------------------ CLI
def _nodes(config: Config, node: str | None) -> list[str]:
    names = node_names(config)
    if node is not None and node not in names:
        raise ConfigError(f"--node: {node!r} is not a node of this config ({', '.join(names)})")
    return [node] if node is not None else names


def _per_node(config: Config, node: str) -> Config:
    return dataclasses.replace(config, kvstore=for_node(config.kvstore, node))


def cmd_store_stats(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        out = {name: store_stats(_per_node(config, name)) for name in _nodes(config, args.node)}
        print(json.dumps(out, indent=2))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_store_clear(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        removed = [p for name in _nodes(config, args.node) for p in store_clear(_per_node(config, name), args.tier)]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StoreBusyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"removed": removed, "note": "device and host tiers live in the serving process; "
                      "restarting it empties them"}))
    return 0


def add_store_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvrelay store stats`` and ``kvrelay store clear`` (handlers return an exit code)."""
    p = subparsers.add_parser("store", help="inspect or clear the tiered KV store")
    sub = p.add_subparsers(dest="store_command", required=True)
    s = sub.add_parser("stats", help="blocks, bytes and hits per tier; LMDB size and free space (JSON)")
    s.add_argument("--config", required=True, help="kvrelay YAML config")
    s.add_argument("--node", default=None, help="one node (e.g. prefill-0); default: every node of the config")
    s.set_defaults(func=cmd_store_stats)
    c = sub.add_parser("clear", help="delete the persistent (disk) tier")
    c.add_argument("--config", required=True, help="kvrelay YAML config")
    c.add_argument("--tier", choices=TIERS_TO_CLEAR, default="all", help="what to clear (default: all = disk)")
    c.add_argument("--node", default=None, help="one node (e.g. prefill-0); default: every node of the config")
    c.set_defaults(func=cmd_store_clear)
