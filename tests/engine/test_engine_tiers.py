"""The engine over a tiered store: a prefix spread over device, host and disk gives the cold-run tokens."""

from __future__ import annotations

import random

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.kvstore.block_key import block_keys
from kvrelay.kvstore.block_record import HEADER_BYTES
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams


def test_prefix_split_across_device_host_disk_matches_cold_run(tiny_model_dir, tmp_path):
    loaded = load_model(tiny_model_dir)
    rng = random.Random(3)
    prompt = [rng.randrange(258) for _ in range(6 * 16 + 5)]  # 6 full blocks + a tail
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    [[cold]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], params)

    store_config = TieredStoreConfig(num_device_blocks=12, num_host_blocks=2, disk_path=str(tmp_path / "disk"),
                                     disk_capacity_bytes=64 * 1024 * 1024, watermark_blocks=0)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=12), store_config=store_config)
    eng.generate([prompt], params)
    keys = block_keys(prompt, block_size_tokens=16, spec_fingerprint=eng.spec.fingerprint)
    # The finished chain (6 prompt blocks + 1 block of output, all keyed) is cached; 5 blocks are free.
    # Taking 5 + 5 blocks evicts the chain tail-first: 6, 5, 4, 3, 2 go to host (2 slots), pushing 6, 5, 4
    # on to disk; blocks 0 and 1 stay on device.
    filler = eng.pool.allocate(eng.pool.stats().num_free)
    evicting = eng.pool.allocate(5)
    eng.store.flush()
    match = eng.store.match_prefix(keys)
    assert match.tiers == ("device", "device", "host", "host", "disk", "disk")
    assert [eng.pool.block_id_of(k) is not None for k in keys] == [True, True, False, False, False, False]
    eng.pool.release(filler + evicting)
    before = eng.store.stats().tier_to_hits
    computed = eng.stats.computed_prefill_tokens
    [[warm]] = eng.generate([prompt], params)
    assert warm == cold
    after = eng.store.stats().tier_to_hits
    assert {t: after[t] - before[t] for t in after} == {"device": 2, "host": 2, "disk": 2}
    assert eng.stats.computed_prefill_tokens - computed == 5  # only the tail was computed
    eng.check_integrity()
    eng.close()


def test_engine_keys_blocks_past_the_tail_cap_cold(tiny_model_dir):
    """With ``cold-tail`` capping new tails at 1 block, a fresh prompt's blocks after its first are keyed
    cold: cached next to evict, tail first, and the head most recent."""
    loaded = load_model(tiny_model_dir)
    rng = random.Random(5)
    prompt = [rng.randrange(258) for _ in range(6 * 16 + 5)]
    eng = LLMEngine(loaded, EngineConfig(num_blocks=16), store_config=TieredStoreConfig(num_device_blocks=16))
    assert eng.store.tail_cap is not None
    eng.store.tail_cap.tail_blocks = 1
    eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    keys = block_keys(prompt, block_size_tokens=16, spec_fingerprint=eng.spec.fingerprint)
    ids = [eng.pool.block_id_of(k) for k in keys]
    order = eng.pool.coldest_cached(7)
    # 7 keyed blocks: 6 of the prompt and one of prompt tail + output (index 6, cold, released first).
    assert order[1:] == [ids[5], ids[4], ids[3], ids[2], ids[1], ids[0]]
    assert order[0] not in ids
    assert [eng.pool.is_cold(b) for b in order] == [True] * 6 + [False]
    eng.check_integrity()
    eng.close()


def _split_engine(loaded, tmp_path, prompt, params, integrity: str) -> tuple[LLMEngine, list]:
    """An engine whose cached prompt lies on device (blocks 0-1), host (2-3) and disk (4-5)."""
    store_config = TieredStoreConfig(num_device_blocks=12, num_host_blocks=2, disk_path=str(tmp_path / "disk"),
                                     disk_capacity_bytes=64 * 1024 * 1024, watermark_blocks=0, integrity=integrity)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=12), store_config=store_config)
    eng.generate([prompt], params)
    keys = block_keys(prompt, block_size_tokens=16, spec_fingerprint=eng.spec.fingerprint)
    taken = eng.pool.allocate(eng.pool.stats().num_free) + eng.pool.allocate(5)
    eng.store.flush()
    assert eng.store.match_prefix(keys).tiers == ("device", "device", "host", "host", "disk", "disk")
    eng.pool.release(taken)
    return eng, keys


def _failures(eng: LLMEngine, where: str) -> float:
    return eng.store.metrics.registry.get_sample_value(
        "kvrelay_kv_integrity_failures_total", {"where": where}) or 0.0


@pytest.mark.parametrize("integrity", ["all", "off"])
def test_a_host_slot_overwritten_before_promotion_is_recomputed(tiny_model_dir, tmp_path, integrity):
    """Issue 16: with integrity on, the damaged host block is a miss — the reference tokens, the failure
    counted at ``host``, blocks 2-5 recomputed; with ``off`` the damage is served."""
    loaded = load_model(tiny_model_dir)
    prompt = [random.Random(3).randrange(258) for _ in range(6 * 16 + 5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    [[cold]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], params)
    eng, keys = _split_engine(loaded, tmp_path, prompt, params, integrity)
    eng.store.host.pool[eng.store.host.slot_of(keys[2])].fill_(1000.0)
    computed = eng.stats.computed_prefill_tokens
    [[warm]] = eng.generate([prompt], params)
    if integrity == "all":
        assert warm == cold and _failures(eng, "host") == 1
        assert eng.stats.computed_prefill_tokens - computed == 4 * 16 + 5
    else:
        assert warm != cold and _failures(eng, "host") == 0
        assert eng.stats.computed_prefill_tokens - computed == 5
    eng.check_integrity()
    eng.close()


def test_an_lmdb_value_altered_while_the_node_was_down_is_recomputed(tiny_model_dir, tmp_path):
    import lmdb

    loaded = load_model(tiny_model_dir)
    prompt = [random.Random(3).randrange(258) for _ in range(6 * 16 + 5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    [[cold]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], params)
    eng, keys = _split_engine(loaded, tmp_path, prompt, params, "sampled")  # disk records: always checked
    eng.store.persist()  # the whole prompt on disk, as a drained node leaves it
    eng.close()
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=3)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = bytearray(txn.get(keys[4]))
        value[HEADER_BYTES + 100] ^= 0x01
        txn.put(keys[4], value)
    env.close()
    store_config = TieredStoreConfig(num_device_blocks=12, disk_path=str(tmp_path / "disk"),
                                     disk_capacity_bytes=64 * 1024 * 1024, watermark_blocks=0)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=12), store_config=store_config)
    assert eng.store.match_prefix(keys).tiers == ("disk",) * 6
    computed = eng.stats.computed_prefill_tokens
    [[warm]] = eng.generate([prompt], params)
    assert warm == cold and _failures(eng, "disk") == 1
    assert eng.stats.computed_prefill_tokens - computed == 2 * 16 + 5  # blocks 4 and 5 and the tail
    eng.check_integrity()
    eng.close()
