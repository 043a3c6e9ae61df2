import dataclasses
import json
import textwrap

import lmdb
import pytest
import torch
from kvrelay.deploy.cli import main
from kvrelay.deploy.config import for_node, load_config
from kvrelay.deploy.store_cmd import StoreBusyError, node_block_spec, store_clear, store_stats
from kvrelay.engine.engine import LLMEngine
from kvrelay.kvstore.block_key import block_keys
from kvrelay.kvstore.block_record import HEADER_BYTES, record_bytes
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.digest import block_digest
from kvrelay.kvstore.lmdb_tier import LmdbOptions, LmdbTier
from kvrelay.kvstore.tiered_store import TieredStore
from kvrelay.model.loader import load_model

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


# ---------------------------------------------------------------------------------------------- verify
@pytest.fixture
def verify_config(tmp_path, monkeypatch, tiny_model_dir):
    """A config serving the tiny model (float32: 2 KiB blocks of 4 tokens) with a disk tier under ``kv``."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "kvrelay.yaml"
    path.write_text(textwrap.dedent(f"""
        model: {{path: {tiny_model_dir}, dtype: float32}}
        kvstore:
          block_size_tokens: 4
          device: {{bytes: 8KiB}}
          disk: {{path: kv, bytes: 1MiB}}
    """))
    return path


def served_spec(model_dir, *, dtype="float32", kv_dtype=None) -> BlockSpec:
    """The spec a node builds: from the loaded model (`deploy.serve.build_engine`)."""
    return LLMEngine.block_spec_for(load_model(model_dir, dtype=dtype), 4, kv_dtype=kv_dtype)


def write_node_tier(tmp_path, spec, num_blocks) -> list[bytes]:
    """``num_blocks`` blocks in node decode-0's disk tier as an integrity-checking store writes them."""
    keys = block_keys(list(range(4 * num_blocks)), block_size_tokens=4, spec_fingerprint=spec.fingerprint)
    tier = LmdbTier(spec, tmp_path / "kv" / "decode-0", capacity_bytes=1 << 20, options=LmdbOptions(checksum="xxh3"))
    for i, key in enumerate(keys):
        block = torch.full(spec.block_shape, float(i), dtype=spec.torch_dtype)
        assert tier.put(key, block, digest=block_digest(key, block))
    tier.close()
    return keys


def flip_payload_byte(path, key) -> None:
    env = lmdb.open(str(path), max_dbs=3)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = bytearray(txn.get(key))
        value[HEADER_BYTES + 100] ^= 0x01
        txn.put(key, bytes(value))
    env.close()


def verify_lines(capsys) -> list[dict]:
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for line in lines:
        assert isinstance(line.pop("seconds"), float)
    return lines


def test_node_block_spec_is_the_spec_a_node_serves_with(tiny_model_dir, tmp_path):
    for model_dtype, kv_dtype in (("float32", None), ("auto", None), ("float32", "bfloat16")):
        path = tmp_path / f"{model_dtype}-{kv_dtype}.yaml"
        kv_line = f"  dtype: {kv_dtype}\n" if kv_dtype else ""
        path.write_text(f"model: {{path: {tiny_model_dir}, dtype: {model_dtype}}}\n"
                        f"kvstore:\n  block_size_tokens: 4\n{kv_line}  device: {{bytes: 8KiB}}\n")
        want = served_spec(tiny_model_dir, dtype=model_dtype, kv_dtype=kv_dtype)
        assert node_block_spec(load_config(path)) == want


def test_verify_reports_a_bad_record_keeps_it_with_keep_then_deletes_it(verify_config, tmp_path, capsys):
    spec = served_spec(load_config(verify_config).model.path)
    keys = write_node_tier(tmp_path, spec, 3)
    flip_payload_byte(tmp_path / "kv" / "decode-0", keys[1])
    node_path = str(tmp_path / "kv" / "decode-0")
    bad = [{"key": keys[1].hex(), "problem": "xxh3 checksum mismatch"}]
    value_bytes = record_bytes(spec.block_bytes, 4096)

    assert main(["store", "verify", "--config", str(verify_config), "--keep"]) == 1
    assert verify_lines(capsys) == [{"node": "decode-0", "path": node_path, "checked": 3, "bytes": 3 * value_bytes,
                                     "bad": bad, "deleted": 0, "moved_aside": []}]
    assert main(["store", "verify", "--config", str(verify_config), "--node", "decode-0"]) == 1
    assert verify_lines(capsys) == [{"node": "decode-0", "path": node_path, "checked": 3, "bytes": 3 * value_bytes,
                                     "bad": bad, "deleted": 1, "moved_aside": []}]
    assert main(["store", "verify", "--config", str(verify_config)]) == 0
    assert verify_lines(capsys) == [{"node": "decode-0", "path": node_path, "checked": 2, "bytes": 2 * value_bytes,
                                     "bad": [], "deleted": 0, "moved_aside": []}]
    disk = store_stats(node_config(verify_config))["tiers"]["disk"]
    assert disk["num_blocks"] == 2 and disk["corrupt"] == 1


def test_verify_refuses_a_running_node_with_exit_2(verify_config, tmp_path, capsys):
    spec = served_spec(load_config(verify_config).model.path)
    write_node_tier(tmp_path, spec, 2)
    serving = LmdbTier(spec, tmp_path / "kv" / "decode-0", capacity_bytes=1 << 20)
    try:
        assert main(["store", "verify", "--config", str(verify_config)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith(f"error: node decode-0: disk tier {tmp_path / 'kv' / 'decode-0'} is in use")
        assert "stop the node first, or copy" in captured.err
    finally:
        serving.close()
    assert main(["store", "verify", "--config", str(verify_config)]) == 0
    assert [line["checked"] for line in verify_lines(capsys)] == [2]


def test_verify_without_a_disk_tier_or_environment_and_with_another_block_size(verify_config, tmp_path, capsys):
    assert main(["store", "verify", "--config", str(verify_config)]) == 0
    assert verify_lines(capsys) == [{"node": "decode-0", "path": str(tmp_path / "kv" / "decode-0"), "checked": 0,
                                     "bytes": 0, "bad": [], "deleted": 0, "moved_aside": [],
                                     "note": "no LMDB environment here yet"}]
    assert not (tmp_path / "kv" / "decode-0").exists()
    spec = served_spec(load_config(verify_config).model.path)
    write_node_tier(tmp_path, dataclasses.replace(spec, block_size_tokens=8), 1)
    assert main(["store", "verify", "--config", str(verify_config)]) == 2
    assert "holds 4096-byte blocks, but model.path, kvstore.block_size_tokens and kvstore.dtype of this config " \
           "make 2048-byte blocks" in capsys.readouterr().err
    no_disk = tmp_path / "no-disk.yaml"
    no_disk.write_text(verify_config.read_text().replace("  disk: {path: kv, bytes: 1MiB}\n", ""))
    assert main(["store", "verify", "--config", str(no_disk)]) == 0
    assert json.loads(capsys.readouterr().out) == {"node": "decode-0", "path": None,
                                                   "note": "no disk tier (kvstore.disk is not set)"}


def test_verify_refuses_records_of_another_model_and_deletes_nothing(verify_config, tmp_path, capsys):
    """Same block size, other fingerprint (another model, or the weights replaced): a config error, not
    corruption — deleting them would empty a good cache."""
    spec = served_spec(load_config(verify_config).model.path)
    keys = write_node_tier(tmp_path, dataclasses.replace(spec, model_fingerprint="other-weights"), 2)
    assert main(["store", "verify", "--config", str(verify_config)]) == 2
    err = capsys.readouterr().err
    assert "node decode-0: 2 of 2 records" in err and "another model or KV layout" in err
    assert "(nothing was deleted)" in err
    tier = LmdbTier(dataclasses.replace(spec, model_fingerprint="other-weights"), tmp_path / "kv" / "decode-0",
                    capacity_bytes=1 << 20)
    try:
        assert all(tier.contains(k) for k in keys)
    finally:
        tier.close()


def test_verify_finds_a_bad_latent_block_of_a_deepseek_model_as_of_a_gqa_one(tmp_path, monkeypatch, capsys):
    """DeepSeek-V3's blocks hold one latent row per token and layer (`BlockSpec.num_planes` 1): the spec ``kvrelay
    store`` builds from config.json is the served one, and a flipped byte in a record is found and deleted."""
    from kvrelay.model.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "ds", arch="deepseek-v3", layers=4)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "ds.yaml"
    config.write_text(f"model: {{path: {model_dir}, dtype: float32}}\n"
                      "kvstore:\n  block_size_tokens: 4\n  device: {bytes: 8KiB}\n  disk: {path: kv, bytes: 1MiB}\n")
    spec = served_spec(model_dir)
    assert node_block_spec(load_config(config)) == spec
    assert (spec.num_planes, spec.num_kv_heads, spec.head_dim, spec.block_bytes) == (1, 1, 40, 4 * 40 * 4 * 4)
    keys = write_node_tier(tmp_path, spec, 3)
    flip_payload_byte(tmp_path / "kv" / "decode-0", keys[2])
    assert main(["store", "verify", "--config", str(config)]) == 1
    [line] = verify_lines(capsys)
    assert (line["checked"], line["bad"], line["deleted"]) == (
        3, [{"key": keys[2].hex(), "problem": "xxh3 checksum mismatch"}], 1)
    assert main(["store", "verify", "--config", str(config)]) == 0
    assert [line["checked"] for line in verify_lines(capsys)] == [2]
