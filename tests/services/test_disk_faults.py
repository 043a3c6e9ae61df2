"""A node whose disk is broken, through `kvrelay up` (issue 30, failure mode 7): a full disk, a disk path
that cannot be a directory, and a truncated ``data.mdb``. The node starts (without its disk tier, or with
a fresh one), says so in ``/health`` and ``/metrics``, and serves the reference tokens."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import lmdb
import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer

from tests.kvstore.test_disk_faults import _try_mount, fill
from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_faults import post

PROMPT = [random.Random(30).randrange(256) for _ in range(70)]  # 4 full blocks and a tail


@pytest.fixture(scope="module")
def reference_text(tiny_model_dir) -> str:
    [[want]] = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=64)).generate(
        [PROMPT], SamplingParams(max_tokens=8))
    return load_tokenizer(tiny_model_dir).decode(want)


def _break(how: str, disk: Path, mounted: list[Path]) -> None:
    """Make the deployment's disk directory ``disk`` (node ``decode-0`` keeps ``disk/decode-0``) broken."""
    if how == "full":
        why = _try_mount(disk, "size=256k,mode=0700")
        if why is not None:
            pytest.skip(f"needs a small tmpfs to fill up: {why}")
        mounted.append(disk)
        fill(disk, leave_kib=0)
    elif how == "not_a_directory":
        disk.write_text("a regular file where the disk directory should be")
    else:  # a data.mdb cut short, as by a crash while the file was copied
        env_dir = disk / "decode-0"
        env_dir.mkdir(parents=True)
        env = lmdb.open(str(env_dir), map_size=64 << 20, max_dbs=3)
        blocks = env.open_db(b"blocks")
        with env.begin(write=True) as txn:
            for i in range(32):
                txn.put(i.to_bytes(32, "big"), os.urandom(64 << 10), db=blocks)
        env.close()
        os.truncate(env_dir / "data.mdb", 64 << 10)


@pytest.mark.parametrize("how, state, words", [
    ("full", "unavailable", "No space left on device"),
    ("not_a_directory", "unavailable", "File exists"),
    ("truncated", "open", None),
])
def test_a_node_on_a_broken_disk_serves(tiny_model_dir, reference_text, how, state, words):
    c = Cluster(tiny_model_dir, overrides={"prefill": {"ports": []}})
    disk = Path(c.config["kvstore"]["disk"]["path"])
    mounted: list[Path] = []
    try:
        _break(how, disk, mounted)
        c.start()
        decode = c.decode_urls[0]
        tier = get_json(decode + "/health")["disk_tier"]
        assert tier["state"] == state and tier["path"] == str(disk / "decode-0")
        m = metrics(decode)
        if state == "unavailable":
            assert words in tier["reason"] and str(disk / "decode-0") in tier["reason"]
            assert m["kvrelay_store_disk_available"] == 0.0
            reason = "ENOSPC" if how == "full" else "EEXIST"
            assert m[f'kvrelay_store_disk_open_failures_total{{reason="{reason}"}}'] == 1.0
            assert any("serving from the device and host tiers without it" in line for line in c.log)
        else:
            assert tier["reason"] is None and m["kvrelay_store_disk_available"] == 1.0
            assert m["kvrelay_store_corrupt_total"] == 1.0
            [moved] = [p for p in disk.iterdir() if p.name.startswith("decode-0.corrupt-")]
            assert (moved / "data.mdb").stat().st_size == 64 << 10
        for _ in range(2):  # the second one hits the first one's blocks (device, or disk after restart)
            code, out = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            assert code == 200, out
            assert out["choices"][0]["text"] == reference_text
        assert get_json(decode + "/health")["pid"] == c.node_pid(decode)  # the same process: no restart
        assert not any("exited with code" in line for line in c.log)
    finally:
        if c._proc is not None:
            c.terminate(timeout_s=120)
        for target in mounted:
            subprocess.run(["umount", "-l", str(target)], check=False, timeout=30)
        c.stop()
