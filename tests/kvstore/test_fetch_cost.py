"""Issue 31: a cached block is fetched from a lower tier only while that is predicted faster than recomputing it."""

from __future__ import annotations

import pytest
from kvrelay.kvstore.fetch_cost import DECAY, FetchCosts

from tests.kvstore.store_helpers import block_value, chain, write_blocks


def costs(recompute_s: float, **fetch_s: float) -> FetchCosts:
    c = FetchCosts()
    c.recompute_s = recompute_s
    c.fetch_s.update(fetch_s)
    return c


def test_the_run_is_cut_where_fetching_the_rest_costs_more_than_recomputing_it():
    run = ("device", "host", "disk", "disk")
    assert FetchCosts().worth_loading(run) == 4  # nothing measured: fetch everything
    assert costs(1.0).worth_loading(run) == 4  # no tier measured yet: fetching is assumed free
    assert costs(1.0, host=0.1, disk=0.5).worth_loading(run) == 4
    # disk blocks cost 2 s each, recomputing 1 s: the gain peaks after the host block
    assert costs(1.0, host=0.1, disk=2.0).worth_loading(run) == 2
    # a slow block first, then fast ones that pay for it: the whole run
    assert costs(1.0, host=0.1, disk=2.0).worth_loading(("disk", "host", "host")) == 3
    assert costs(1.0, disk=2.0).worth_loading(("disk", "disk")) == 0
    assert costs(1.0, disk=1.0).worth_loading(("disk", "disk")) == 2  # a tie fetches


def test_fetch_times_are_decayed_per_tier():
    c = FetchCosts()
    c.observe("disk", 0.004)
    c.observe("disk", 0.002)
    c.observe("host", 0.0001)
    c.observe("host", -1.0)  # ignored
    assert c.fetch_s == {"disk": pytest.approx((1 - DECAY) * 0.004 + DECAY * 0.002), "host": 0.0001}


def test_a_store_recomputes_host_blocks_slower_to_fetch_than_to_compute(make_store):
    keys = chain(4)
    store = make_store(num_device_blocks=4, num_host_blocks=4, watermark_blocks=0)
    ids = write_blocks(store, keys, [block_value(i) for i in range(4)])
    store.block_pool.release(ids)
    store.block_pool.release(store.block_pool.allocate(4))  # all four demoted to host
    match = store.match_prefix(keys)
    assert match.tiers == ("host",) * 4
    loaded = store.load(keys[:2], store.match_prefix(keys[:2]))  # measures the host tier's fetches
    assert len(loaded) == 2 and store.fetch_costs.fetch_s["host"] > 0
    store.block_pool.release(loaded)
    store.block_pool.release(store.block_pool.allocate(4))  # back to host
    store.fetch_costs.recompute_s = store.fetch_costs.fetch_s["host"] / 10  # computing is 10x faster
    assert store.load(keys, store.match_prefix(keys)) == []
    assert store.metrics.registry.get_sample_value("kvrelay_store_fetch_skipped_blocks_total") == 4
    assert store.host.contains(keys[0])  # left where it was
    store.fetch_costs.recompute_s = store.fetch_costs.fetch_s["host"] * 10  # computing is 10x slower
    assert len(store.load(keys, store.match_prefix(keys))) == 4
