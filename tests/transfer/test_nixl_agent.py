"""`KvAgent` on its own: loopback local copies through NIXL, the torch fallback, and what it publishes."""

from __future__ import annotations

import logging

import pytest
import torch
from kvrelay.transfer.nixl_agent import KvAgent

from tests.transfer.harness import SPEC
from tests.transfer.owner_proc import words_of


def pools(num_device: int = 16, num_host: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    device = SPEC.new_pool(num_device)
    words_of(device).copy_(torch.randint(-(2**31), 2**31 - 1, (device.numel(),), dtype=torch.int32,
                                         generator=torch.Generator().manual_seed(0)))
    return device, SPEC.new_pool(num_host)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(words_of(a), words_of(b))


def test_local_copy_goes_through_nixl_loopback_both_ways():
    device, host = pools()
    agent = KvAgent("loop-a", SPEC, [("device", device), ("host", host)])
    try:
        assert agent.local_copy("device", [5, 0, 9], "host", [2, 7, 0]) == "nixl"
        assert same_bytes(host[2], device[5]) and same_bytes(host[7], device[0]) and same_bytes(host[0], device[9])
        assert not host[[1, 3, 4, 5, 6]].any()
        assert agent.local_copy("host", [7], "device", [15]) == "nixl"  # recall
        assert same_bytes(device[15], device[0])
        with pytest.raises(ValueError, match="out of range for tier 'host'"):
            agent.local_copy("device", [0], "host", [8])
        with pytest.raises(ValueError, match="2 source blocks but 1"):
            agent.local_copy("device", [0, 1], "host", [1])
    finally:
        agent.close()


def test_tiers_nixl_cannot_register_fall_back_to_torch_and_are_not_published(caplog):
    device, host = pools()
    with caplog.at_level(logging.WARNING, logger="kvrelay.transfer.nixl_agent"):
        agent = KvAgent("loop-b", SPEC, [("device", device), ("host", host)], backends=())
    try:
        assert "NIXL cannot register tier 'device'" in caplog.text
        assert not agent.is_registered("device") and not agent.is_registered("host")
        assert agent.meta.tiers == ()
        assert agent.local_copy("device", [3], "host", [4]) == "torch"
        assert same_bytes(host[4], device[3])
    finally:
        agent.close()


def test_meta_describes_each_registered_pool():
    device, host = pools()
    agent = KvAgent("loop-c", SPEC, [("device", device), ("host", host)])
    try:
        regions = {r.name: r for r in agent.meta.tiers}
        assert regions["device"].base_addr == device.data_ptr()
        assert regions["host"].block_addr(3) == host[3].data_ptr()
        assert (regions["device"].num_blocks, regions["device"].block_bytes) == (16, SPEC.block_bytes)
        assert agent.meta.spec_fingerprint == SPEC.fingerprint and agent.meta.nixl_metadata
    finally:
        agent.close()


def test_pools_of_the_wrong_layout_are_refused():
    with pytest.raises(ValueError, match="tier 'device': pool is"):
        KvAgent("bad", SPEC, [("device", torch.zeros(4, 8))])
    with pytest.raises(ValueError, match="contiguous"):
        KvAgent("bad", SPEC, [("device", SPEC.new_pool(8)[::2])])
