"""``kvrelay store stats|clear|verify --config FILE``: look at, empty or check the tiered KV store from outside.

The device and host tiers live in the serving process's memory, so from here only their configured
sizes are known; the disk tier is read directly (read-only, safe while a server runs). Hits per tier
and queries are the lifetime counters a serving process persists in the disk tier (absent without one).
Every engine node keeps its own disk tier (``disk.path/<node>``), so the commands work per node:
all the config's nodes by default, or ``--node NAME``.

``verify`` opens a node's disk tier as its owner (the node must be stopped), checks every record's
header and checksum (`kvstore.lmdb_tier.LmdbTier.verify`) and deletes the bad ones (``--keep``: only
reports them). It prints one JSON line per node and exits 1 when it found a bad record, 2 on an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
from kvrelay.deploy.config import Config, KvStoreConfig, for_node, load_config, node_names
from kvrelay.deploy.sizes import ConfigError
from kvrelay.kvstore.lmdb_env import CORRUPTION_ERRORS, DiskTierInUseError, OwnerLock, is_owned, read_snapshot

if TYPE_CHECKING:  # they load torch, which `stats` and `clear` (and the router process) do without
    from kvrelay.kvstore.block_spec import BlockSpec

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


def node_block_spec(config: Config) -> BlockSpec:
    """The KV block layout the nodes of ``config`` serve with, without loading the weights: the same
    fields `engine.engine.LLMEngine.block_spec_for` takes from the loaded model (``model.path``'s
    ``config.json``, its weights fingerprint, the weights dtype ``model.dtype`` resolves to on
    ``model.device``, or ``kvstore.dtype``).

    Raises:
        ConfigError: ``model.path`` is not a readable model directory.
    """
    from kvrelay.deploy.model_source import resolve_config_model
    from kvrelay.engine.kv_layout import kv_block_spec
    from kvrelay.model.config import read_model_config
    from kvrelay.model.device import resolve_device
    from kvrelay.model.dtype import resolve_dtype
    from kvrelay.model.loader import model_fingerprint

    m, kv = resolve_config_model(config).model, config.kvstore  # a hub repo id: its snapshot
    try:
        model = read_model_config(m.path)
        fingerprint = model_fingerprint(m.path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: {exc}") from None
    return kv_block_spec(model, fingerprint=fingerprint, block_size_tokens=kv.block_size_tokens,
                         dtype=kv.dtype or resolve_dtype(m.dtype, resolve_device(m.device)))


def store_verify(config: Config, node: str, spec: Callable[[], BlockSpec], *, delete: bool = True) -> dict[str, Any]:
    """Check every record of node ``node``'s disk tier against the layout ``spec()`` (`LmdbTier.verify`;
    called only when there is a tier to open, e.g. `node_block_spec`), deleting the bad ones unless not
    ``delete``. Returns ``{node, path, checked, bytes, bad: [{key, problem}], deleted, seconds,
    moved_aside}`` (``moved_aside``: an environment LMDB could not open, which opening it moved aside), or
    ``{node, path: None, note}`` without a disk tier. Nothing is created where no tier exists yet.

    Raises:
        ConfigError: the tier holds blocks of another size than ``spec``'s (another model or config), or
            ``kvstore.disk.bytes`` cannot hold one block.
        StoreBusyError: a running process owns the tier.
        one of CORRUPTION_ERRORS / lmdb.Error / OSError: see `LmdbTier.verify`.
    """
    from kvrelay.kvstore.lmdb_tier import LmdbTier

    kv = for_node(config.kvstore, node)
    if kv.disk is None:
        return {"node": node, "path": None, "note": "no disk tier (kvstore.disk is not set)"}
    path = Path(kv.disk.path)
    result: dict[str, Any] = {"node": node, "path": str(path)}
    if not (path / "data.mdb").exists():
        return result | {"checked": 0, "bytes": 0, "bad": [], "deleted": 0, "seconds": 0.0, "moved_aside": [],
                         "note": "no LMDB environment here yet"}
    busy = StoreBusyError(
        f"node {node}: disk tier {path} is in use by a running kvrelay process; stop the node first, or copy "
        f"{path} to DIR/{node} and verify the copy with kvstore.disk.path: DIR"
    )
    if is_owned(path):  # before reading it: LMDB refuses a second open of one environment in a process
        raise busy
    snap = read_snapshot(path)
    block_spec = spec()
    if snap is not None and snap.block_bytes and snap.block_bytes != block_spec.block_bytes:
        raise ConfigError(
            f"node {node}: disk tier {path} holds {snap.block_bytes}-byte blocks, but model.path, "
            f"kvstore.block_size_tokens and kvstore.dtype of this config make {block_spec.block_bytes}-byte blocks; "
            f"verify with the config the node serves with"
        )
    try:
        tier = LmdbTier(block_spec, path, capacity_bytes=kv.disk.size_bytes)
    except DiskTierInUseError:  # the node started meanwhile
        raise busy from None
    except ValueError as exc:
        raise ConfigError(f"kvstore.disk.bytes: {exc}") from None
    failures = tier.metrics.integrity_failures.labels("verify")
    try:
        # Look first: records of another model or KV layout mean this config is not the node's, not that
        # the store is corrupt; deleting them would empty a good cache.
        from kvrelay.kvstore.block_record import FOREIGN_PROBLEM

        report = tier.verify(delete=False)
        foreign = sum(b.problem == FOREIGN_PROBLEM for b in report.bad)
        if foreign:
            raise ConfigError(
                f"node {node}: {foreign} of {report.num_checked} records in {path} were written for another model "
                f"or KV layout than this config's (model.path, model.dtype, kvstore.dtype); verify with the "
                f"config the node serves with (nothing was deleted)")
        if delete and report.bad:
            report = tier.verify(delete=True, on_bad=lambda key, problem: failures.inc())
        moved_aside = list(tier.disk_stats().moved_aside)
    finally:
        tier.close()
    return result | {
        "checked": report.num_checked, "bytes": report.checked_bytes,
        "bad": [{"key": b.key.hex(), "problem": b.problem} for b in report.bad], "deleted": report.num_deleted,
        "seconds": round(report.elapsed_s, 3), "moved_aside": moved_aside,
    }


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


def cmd_store_verify(args: argparse.Namespace) -> int:
    """One JSON line per node as it is done. Exit 1 if a bad record was found (or a corrupt environment
    moved aside, or LMDB reports one corrupt), 2 on a config error, a running node or an I/O error."""
    found_bad = False
    try:
        config = load_config(args.config)
        names = _nodes(config, args.node)
        spec = functools.cache(lambda: node_block_spec(config))  # read the model directory once, if at all
        for name in names:
            try:
                out = store_verify(config, name, spec, delete=not args.keep)
            except CORRUPTION_ERRORS as exc:
                print(f"error: node {name}: LMDB reports its disk tier corrupt ({exc}); "
                      f"`kvrelay store clear --node {name}` removes it", file=sys.stderr)
                return 1
            except (lmdb.Error, OSError) as exc:
                print(f"error: node {name}: cannot read its disk tier ({type(exc).__name__}: {exc})", file=sys.stderr)
                return 2
            found_bad = found_bad or bool(out.get("bad")) or bool(out.get("moved_aside"))
            print(json.dumps(out), flush=True)
    except (ConfigError, StoreBusyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if found_bad else 0


def add_store_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvrelay store stats|clear|verify`` (handlers return an exit code)."""
    p = subparsers.add_parser("store", help="inspect, clear or verify the tiered KV store")
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
    v = sub.add_parser("verify", help="check every disk tier record's header and checksum, delete bad ones "
                                      "(JSON line per node; exit 1 if any was bad). The node must be stopped")
    v.add_argument("--config", required=True, help="kvrelay YAML config")
    v.add_argument("--node", default=None, help="one node (e.g. prefill-0); default: every node of the config")
    v.add_argument("--keep", action="store_true", help="report bad records without deleting them")
    v.set_defaults(func=cmd_store_verify)
