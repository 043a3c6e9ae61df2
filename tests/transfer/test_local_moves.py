"""Device<->host moves of the tiered store go through the node's NIXL agent as loopback transfers."""

from __future__ import annotations

import random

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.kvstore.block_key import block_keys
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.transfer.node_agent import make_agent


def test_demotion_and_promotion_move_through_nixl(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    rng = random.Random(4)
    prompt = [rng.randrange(258) for _ in range(4 * 16 + 3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [[cold]] = LLMEngine(loaded, EngineConfig(num_blocks=32)).generate([prompt], params)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=8),
                    store_config=TieredStoreConfig(num_device_blocks=8, num_host_blocks=8, watermark_blocks=0))
    agent = make_agent(eng, "local-moves")
    try:
        eng.generate([prompt], params)
        keys = block_keys(prompt, block_size_tokens=16, spec_fingerprint=eng.spec.fingerprint)
        saved = {k: eng.kv_pool[eng.pool.block_id_of(k)].clone() for k in keys}
        held = eng.pool.allocate(eng.pool.num_free_blocks)  # evicts every cached block to host
        assert eng.store.match_prefix(keys).tiers == ("host",) * 4
        for k in keys:
            assert torch.equal(eng.store.host.pool[eng.store.host.slot_of(k)], saved[k])
        eng.pool.release(held)
        [[warm]] = eng.generate([prompt], params)  # promotes the 4 blocks back from host
        assert warm == cold
        for k in keys:
            assert torch.equal(eng.kv_pool[eng.pool.block_id_of(k)], saved[k])
        assert eng.store.local_copy_paths.get("nixl", 0) >= 8 and "torch" not in eng.store.local_copy_paths
        eng.check_integrity()
    finally:
        agent.close()
        eng.close()


def test_layer_slices_move_alone_through_nixl(tiny_model_dir):
    """InfiniGen's per-layer recall: one layer of a host block lands in one layer of a device block."""
    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=8),
                    store_config=TieredStoreConfig(num_device_blocks=8, num_host_blocks=4, watermark_blocks=0))
    agent = make_agent(eng, "layer-moves")
    try:
        host = eng.store.host.pool
        host.copy_(torch.randn(host.shape, generator=torch.Generator().manual_seed(0)).to(host.dtype))
        eng.kv_pool.zero_()
        layers = eng.spec.num_layers
        assert agent.local_copy("host", [2, 1], "device", [5, 3], layers=[layers - 1, 0]) == "nixl"
        want = torch.zeros_like(eng.kv_pool)
        want[5, layers - 1] = host[2, layers - 1]
        want[3, 0] = host[1, 0]
        assert torch.equal(eng.kv_pool, want)
        assert eng.store.local_copy is not None
        with pytest.raises(ValueError, match="layers must give one index"):
            agent.local_copy("host", [0], "device", [0], layers=[layers])
    finally:
        agent.close()
