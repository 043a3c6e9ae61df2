"""A planned stop keeps the warm KV (issue 30, failure mode 8): on SIGTERM, `kvrelay up` waits for each
node to write its device and host tiers to disk (``internal.persist_timeout_s``), however long past the
drain that takes, and exits 0; every block the tiers held is in the node's LMDB environment afterwards.

The disk is made slow (a test-side ``sitecustomize``: ``tests/services/slow_disk``) so that writing the
tiers takes longer than the drain plus the 10 s `kvrelay up` used to give before SIGKILL."""

from __future__ import annotations

import random
from pathlib import Path

import lmdb
import msgpack
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.router.app import salt_for_key
from kvrelay.transfer.config import TOKEN_HEADER

from tests.services.cluster import Cluster, metrics
from tests.services.test_faults import post

SLOW_DISK = Path(__file__).resolve().parent / "slow_disk"
PROMPTS = [[random.Random(seed).randrange(256) for _ in range(70)] for seed in range(12)]  # 4 full blocks each
BLOCK_BYTES = 8192  # the tiny model's block: 2 layers x K,V x 2 heads x 16 tokens x 16 dims x 4 bytes
S_PER_BLOCK = 0.25  # 48 blocks: at least 12 s of writing, past the old 1 s drain + 10 s


def test_sigterm_waits_for_the_host_tier_to_reach_disk_and_exits_0(tiny_model_dir):
    import urllib.request

    overrides = {"prefill": {"ports": []}, "internal": {"drain_timeout_s": 1},
                 "kvstore": {"device": {"bytes": 32 * BLOCK_BYTES}}}
    env = {"PYTHONPATH": str(SLOW_DISK), "KVRELAY_TEST_SLOW_DISK_S_PER_BLOCK": str(S_PER_BLOCK)}
    c = Cluster(tiny_model_dir, overrides=overrides, env=env)
    disk = Path(c.config["kvstore"]["disk"]["path"]) / "decode-0"
    try:
        c.start()
        decode = c.decode_urls[0]
        req = urllib.request.Request(decode + "/info", headers={TOKEN_HEADER: c.token})
        with urllib.request.urlopen(req, timeout=10) as resp:
            info = msgpack.unpackb(resp.read())
        engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=8))
        assert engine.spec.fingerprint == info["spec_fingerprint"] and engine.spec.block_bytes == BLOCK_BYTES
        salt = salt_for_key(None)  # no API keys: the anonymous tenant's salt
        want = {k for p in PROMPTS for k in engine.prompt_block_keys(p, salt)}
        assert len(want) == 48
        for prompt in PROMPTS:
            code, out = post(c.url, {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert code == 200, out
        m = metrics(decode)
        host = m['kvrelay_kv_blocks{state="stored",tier="host"}']
        assert host >= 16  # the 32-block device tier pushed at least 48 - 32 prompt blocks down to host
        assert m['kvrelay_kv_blocks{state="stored",tier="disk"}'] == 0  # nothing on disk before the stop
        assert c.terminate(timeout_s=300) == 0
        log = "".join(c.log)
        assert "SIGKILL" not in log, log[-3000:]
        assert "decode-0: 48 KV blocks written to disk before stopping" in log
        env_ = lmdb.open(str(disk), readonly=True, lock=False, max_dbs=3, subdir=True)
        try:
            with env_.begin() as txn:
                stored = {bytes(k) for k in txn.cursor(db=env_.open_db(b"blocks", txn=txn, create=False))
                          .iternext(values=False)}
        finally:
            env_.close()
        assert want <= stored, f"{len(want - stored)} of {len(want)} blocks are not on disk"
    finally:
        c.stop()
