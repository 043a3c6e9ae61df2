"""The store on CUDA (issue 19; run by scripts/gpu-check.sh): a pinned host tier with asynchronous copies on a
side stream, digests by the Triton kernel, and NVML's real free-memory reading. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from kvrelay.deploy.config import DeviceTierConfig, nvml_free_bytes
from kvrelay.kvstore.digest import block_digest
from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig

from tests.kvstore.store_helpers import SPEC, block_value, chain

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_blocks_demoted_to_pinned_host_and_promoted_back_are_bit_exact_and_pass_their_digests():
    keys = chain(24)
    store = TieredStore(SPEC, TieredStoreConfig(num_device_blocks=8, num_host_blocks=32, watermark_blocks=4,
                                                device="cuda", integrity="all"))
    assert store.host.pool.is_pinned() and store.device_pool.is_cuda
    values = [block_value(i) for i in range(24)]
    for i in range(0, 24, 4):  # write 4, release them, and let the watermark pre-copy on the side stream
        ids = store.block_pool.allocate(4)
        for j, b in enumerate(ids):
            store.device_pool[b].copy_(values[i + j])
        store.block_pool.register_keys(ids, keys[i : i + 4], [False] * 4)
        store.block_pool.release(ids)
        if i:  # the pool is full from the second round on: the watermark pre-copies on the side stream
            assert store.maintain_watermark() > 0
    torch.cuda.synchronize()
    digests = [block_digest(k, v) for k, v in zip(keys, values)]
    for k, d in zip(keys, digests):  # the Triton kernel's digests (taken on device) equal xxhash's on the CPU
        where = store.block_pool.block_id_of(k)
        assert (store.block_pool.digest_of(where) if where is not None else store.host.digest_of(k)) == d
    # The device holds the last 8 blocks written; the first 16 are on the host. Loading 8 of those fills the
    # whole device pool: each allocation evicts a cached block (its copy already on the host).
    match = store.match_prefix(keys[:8])
    assert match.num_hits("host") == 8
    ids = store.load(keys[:8], match)
    assert len(ids) == 8
    for i, b in enumerate(ids):
        assert torch.equal(store.device_pool[b].cpu(), values[i]), f"block {i}"
    assert store.metrics.registry.get_sample_value("kvrelay_kv_integrity_failures_total", {"where": "host"}) is None
    store.block_pool.release(ids)
    store.check_integrity()
    store.close()


def test_nvml_reads_free_memory_and_a_fraction_sizes_the_device_tier():
    free = nvml_free_bytes()
    assert abs(free - torch.cuda.mem_get_info()[0]) < 1 << 30  # the same device, read two ways
    got = DeviceTierConfig(free_memory_frac=0.5).resolve_bytes("cuda")  # GPU memory, not the host's
    assert abs(got - free // 2) < 1 << 30  # other processes may allocate between the two readings
