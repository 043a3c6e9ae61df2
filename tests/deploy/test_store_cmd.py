import dataclasses
import json
import textwrap

import pytest

from deploy.cli import main
from deploy.config import for_node, load_config
from deploy.store_cmd import StoreBusyError, store_clear, store_stats
from kvstore.block_key import block_keys
from kvstore.block_spec import BlockSpec
from kvstore.tiered_store import TieredStore

SPEC = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4)  # 2 KiB blocks


@pytest.fixture
def config_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "kvrelay.yaml"
    path.write_text(textwrap.dedent("""
        model: {path: m}
        kvstore:
          block_size_tokens: 4
          device: {bytes: 8KiB}
          host: {bytes: 4KiB}
          disk: {path: kv, bytes: 1MiB}
    """))
    return path


def node_config(config_path):
    """The config as its one node, ``decode-0``, sees it (its disk tier is ``kv/decode-0``)."""
    config = load_config(config_path)
    return dataclasses.replace(config, kvstore=for_node(config.kvstore, "decode-0"))


def fill(config_path) -> TieredStore:
    """A serving store: 4 device blocks, 2 host blocks; a 6-block prompt pushes 2 blocks to disk."""
    store = TieredStore(SPEC, node_config(config_path).kvstore.store_config(SPEC))
    keys = block_keys(list(range(24)), block_size_tokens=4, spec_fingerprint=SPEC.fingerprint)
    store.match_prefix(keys)
    for key in keys:
        [block_id] = store.block_pool.allocate(1)
        store.block_pool.register_key(block_id, key)
        store.block_pool.release([block_id])
    store.match_prefix(keys)  # blocks 0, 1 were evicted to host; 2..5 are on device
    store.flush()
    return store


def test_stats_reports_blocks_bytes_and_hits_per_tier(config_path):
    store = fill(config_path)
    store.check_integrity()
    store.close()
    stats = store_stats(node_config(config_path))
    assert stats["block_size_tokens"] == 4 and stats["block_bytes"] == 2048
    assert stats["queries"] == 12
    device, host, disk = (stats["tiers"][t] for t in ("device", "host", "disk"))
    assert device == {"configured_bytes": 8192, "fraction_of_free": None, "capacity_blocks": 4, "hits": 4}
    assert host == {"configured_bytes": 4096, "capacity_blocks": 2, "hits": 2}
    assert disk["num_blocks"] == 0 and disk["free_bytes"] == 1 << 20 and disk["hits"] is None


def test_hits_and_disk_blocks_after_a_restart(config_path):
    store = fill(config_path)
    store.block_pool.release(store.block_pool.allocate(4))  # device → host → disk
    keys = block_keys(list(range(24)), block_size_tokens=4, spec_fingerprint=SPEC.fingerprint)
    assert store.match_prefix(keys).tiers == ("disk",) * 4 + ("host",) * 2
    store.check_integrity()
    store.close()
    stats = store_stats(node_config(config_path))
    disk = stats["tiers"]["disk"]
    block_on_disk = 4096 + 128  # one overflow page and its share of leaf pages
    assert disk["num_blocks"] == 4 and disk["used_bytes"] == 4 * block_on_disk and disk["hits"] == 4
    assert disk["free_bytes"] == (1 << 20) - 4 * block_on_disk and disk["lmdb_map_bytes"] == 1 << 20
    assert stats["tiers"]["host"]["hits"] == 4 and stats["queries"] == 18


def test_clear_refuses_while_served_then_removes_disk_and_moved_aside(config_path, tmp_path):
    store = fill(config_path)
    store.persist()
    with pytest.raises(StoreBusyError, match="in use by another kvrelay process"):
        store_clear(node_config(config_path))
    assert main(["store", "clear", "--config", str(config_path)]) == 1
    store.close()
    (tmp_path / "kv" / "decode-0.corrupt-20260101-000000-1").mkdir()
    assert main(["store", "clear", "--config", str(config_path), "--tier", "disk"]) == 0
    assert not (tmp_path / "kv" / "decode-0").exists()
    assert not (tmp_path / "kv" / "decode-0.corrupt-20260101-000000-1").exists()
    assert store_clear(node_config(config_path)) == []


def test_cli_stats_prints_json_and_bad_config_exits_2(config_path, tmp_path, capsys):
    assert main(["store", "stats", "--config", str(config_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["decode-0"] and out["decode-0"]["tiers"]["disk"]["path"] == str(tmp_path / "kv" / "decode-0")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m}\nkvstore: {device: {bytes: 8GB}}\n")
    assert main(["store", "stats", "--config", str(bad)]) == 2
    assert "kvstore.device.bytes: '8GB' is not a size" in capsys.readouterr().err
