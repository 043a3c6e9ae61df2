"""Tier policies (`kvstore.policy`): where blocks enter each tier's order, what the store evicts, and that
the store evicts exactly what the offline simulator of the same policy evicts."""

from __future__ import annotations

import random

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kvrelay.deploy.config import parse_config
from kvrelay.deploy.sizes import ConfigError
from kvrelay.kvstore.block_pool import BlockPool, NoFreeBlocksError
from kvrelay.kvstore.host_tier import HostTier
from kvrelay.kvstore.policy import PolicySim, ShadowLru, TailCap, parse_policy
from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig

from .store_helpers import SPEC, block_value, chain


# ------------------------------------------------------------------ parsing
def test_parse_policy_accepts_the_names_and_names_them_when_wrong():
    assert parse_policy(" LRU ") == "lru"
    assert parse_policy("cold-tail") == "cold-tail"
    with pytest.raises(ValueError, match="'arc' is not a tier policy; use one of lru, cold-tail"):
        parse_policy("arc")
    with pytest.raises(ValueError, match="device_policy: 3 is not a tier policy"):
        TieredStoreConfig(num_device_blocks=4, device_policy=3)  # type: ignore[arg-type]


def test_yaml_policy_per_tier(tmp_path):
    raw = yaml.safe_load("""
model: {path: m}
kvstore:
  block_size_tokens: 4
  device: {bytes: 1MiB, policy: lru}
  host: {bytes: 2MiB}
  disk: {path: d, bytes: 4MiB, policy: LRU}
""")
    kv = parse_config(raw, base_dir=tmp_path).kvstore
    assert (kv.device.policy, kv.host.policy, kv.disk.policy) == ("lru", "cold-tail", "lru")
    store = kv.store_config(SPEC)
    assert (store.device_policy, store.host_policy, store.disk_policy) == ("lru", "cold-tail", "lru")
    raw["kvstore"]["host"]["policy"] = "lfu"
    with pytest.raises(ConfigError, match=r"kvstore\.host\.policy: 'lfu' is not a tier policy; use one of "
                                          r"lru, cold-tail"):
        parse_config(raw, base_dir=tmp_path)


# ------------------------------------------------------------------ device
def test_pool_caches_cold_blocks_next_to_evict_tail_first():
    pool = BlockPool(8, honour_cold=True)
    keys = chain(6)
    ids = pool.allocate(6)
    for i, (b, k) in enumerate(zip(ids, keys, strict=True)):
        pool.register_key(b, k, cold=i >= 2)
    pool.release(ids)
    # Released back to front: hot blocks most recent, head last; cold ones first to go, tail first.
    assert pool.coldest_cached(6) == [ids[5], ids[4], ids[3], ids[2], ids[1], ids[0]]
    assert [pool.is_cold(b) for b in ids] == [False, False, True, True, True, True]
    # A reference that is not a hit (a lease, a fork) leaves a block cold: released, it goes first again.
    pool.acquire([ids[2]])
    assert pool.is_cold(ids[2])
    pool.release([ids[2]])
    assert pool.coldest_cached(6) == [ids[2], ids[5], ids[4], ids[3], ids[1], ids[0]]
    # A hit (`warm`, as the store's load does) makes a cold block ordinary: released, it is the most recent.
    pool.acquire([ids[3]])
    pool.warm([ids[3]])
    assert not pool.is_cold(ids[3])
    pool.release([ids[3]])
    assert pool.coldest_cached(6) == [ids[2], ids[5], ids[4], ids[1], ids[0], ids[3]]
    # Allocation evicts in that order, after the 2 free blocks.
    got = pool.allocate(4)
    assert got[2:] == [ids[2], ids[5]]
    pool.check_integrity()


def test_pool_without_honour_cold_keeps_lru_order_but_reports_cold():
    pool = BlockPool(4)
    keys = chain(3)
    ids = pool.allocate(3)
    for i, (b, k) in enumerate(zip(ids, keys, strict=True)):
        pool.register_key(b, k, cold=i >= 1)
    pool.release(ids)
    assert pool.coldest_cached(3) == [ids[2], ids[1], ids[0]]
    assert [pool.is_cold(b) for b in ids] == [False, True, True]


def test_pool_never_evicts_in_use_cold_blocks():
    pool = BlockPool(4, honour_cold=True)
    ids = pool.allocate(4)
    for b, k in zip(ids, chain(4), strict=True):
        pool.register_key(b, k, cold=True)
    pool.release(ids[2:])
    with pytest.raises(NoFreeBlocksError, match="need 3 KV blocks but only 2 are free or evictable"):
        pool.allocate(3)
    assert pool.allocate(2) == [ids[3], ids[2]]  # tail first
    assert [pool.ref_count(b) for b in ids] == [1, 1, 1, 1]
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.booleans()), min_size=1, max_size=40),
       st.booleans())
def test_pool_cold_orders_keep_integrity(ops, honour):
    """Random allocate / key (hot or cold) / hit / release: capacity holds, integrity holds, and no block
    with a reference is ever evicted."""
    pool = BlockPool(6, honour_cold=honour)
    held: list[list[int]] = []
    evicted_in_use: list[int] = []
    pool._on_evict = lambda b, k: evicted_in_use.extend(  # noqa: SLF001
        [b] if any(b in h for h in held) else [])
    next_token = 0
    for op, n, cold in ops:
        if op <= 2 and n <= pool.num_free_blocks:
            ids = pool.allocate(n)
            for b, k in zip(ids, chain(n, first_token=next_token), strict=True):
                pool.register_key(b, k, cold=cold)
            next_token += 1000
            held.append(ids)
        elif op == 3 and pool.num_cached_blocks:
            b = pool.coldest_cached(n)[-1]
            pool.acquire([b])
            if cold:
                pool.warm([b])
            held.append([b])
        elif held:
            pool.release(held.pop(0))
        pool.check_integrity()
        assert pool.stats().num_in_use == sum(len(h) for h in held)
    assert evicted_in_use == []


# -------------------------------------------------------------------- host
def test_host_puts_cold_keys_next_to_evict_and_a_read_warms_them():
    host = HostTier(SPEC, 4, honour_cold=True)
    keys = chain(5)
    for i, k in enumerate(keys[:4]):
        assert host.put(k, block_value(i), cold=i in (1, 2))
    assert host.keys_lru_first() == [keys[2], keys[1], keys[0], keys[3]]
    assert host.is_cold(keys[1]) and not host.is_cold(keys[0])
    assert host.put(keys[1], block_value(1), cold=True)  # held already: stays where it is, cold
    assert host.keys_lru_first() == [keys[2], keys[1], keys[0], keys[3]]
    dst = block_value(99)
    assert host.get_into(keys[1], dst)
    assert not host.is_cold(keys[1])
    assert host.keys_lru_first() == [keys[2], keys[0], keys[3], keys[1]]
    evicted: list[bytes] = []
    host._on_evict = lambda slot, k: evicted.append(k)  # noqa: SLF001
    assert host.put(keys[4], block_value(4))
    assert evicted == [keys[2]]
    assert not host.is_cold(keys[2])
    host.check_integrity()


def test_host_reserved_slots_are_never_evicted_whatever_the_policy():
    host = HostTier(SPEC, 3, honour_cold=True)
    reserved = host.reserve(2)
    assert reserved is not None
    keys = chain(3)
    assert host.put(keys[0], block_value(0), cold=True)
    assert host.put(keys[1], block_value(1))  # evicts keys[0], the only keyed slot
    assert host.keys_lru_first() == [keys[1]]
    assert host.stats().num_blocks == 1 and host.num_reserved == 2
    host.check_integrity()


# ------------------------------------------------------------------ tail cap
def _script(seed: int, n: int) -> list[list[bytes]]:
    """Prompts as chains: a few shared heads, conversations that come back extended, one-off tails."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    out = []
    for _ in range(n):
        if convs and rng.random() < 0.4:
            conv = rng.choice(convs)
            conv.extend(rng.randrange(1 << 30) for _ in range(rng.randint(1, 3)))
        else:
            conv = [rng.randrange(3)] + [rng.randrange(1 << 30) for _ in range(rng.randint(1, 8))]
            convs.append(conv)
        tokens = [t for block in conv for t in [block] * SPEC.block_size_tokens]
        out.append(chain_of(tokens))
    return out


def chain_of(tokens: list[int]) -> list[bytes]:
    from kvrelay.kvstore.block_key import block_keys

    return block_keys(tokens, block_size_tokens=SPEC.block_size_tokens, spec_fingerprint=SPEC.fingerprint)


def test_tail_cap_follows_the_shadow_that_hit_most():
    prompts = _script(1, 60)
    cap = TailCap(12, candidates=(1, 3, None), epoch=60, decay=1.0, hysteresis=1.0)
    for keys in prompts[:-1]:
        assert cap.observe(keys) is None  # no cap until the first epoch ends
    last = cap.observe(prompts[-1])
    hits = []
    for m in (1, 3, None):
        shadow = ShadowLru(12)
        hits.append(sum(shadow.request(k, k, m) for k in prompts if len(k) <= 12))  # TailCap skips larger
    assert hits[0] != hits[2]  # the script separates the candidates
    best = max(range(3), key=lambda i: hits[i])
    assert cap.tail_blocks == (1, 3, None)[best]
    assert last == cap.tail_blocks  # the prompt that ends the epoch gets the new choice


def test_tail_cap_keeps_lru_unless_another_candidate_clearly_wins():
    cap = TailCap(12, candidates=(1, None), epoch=10, hysteresis=1e9)
    for keys in _script(2, 40):
        assert cap.observe(keys) is None
    assert cap.tail_blocks is None
    with pytest.raises(ValueError, match="must include None"):
        TailCap(4, candidates=(1, 2))


def test_shadow_lru_scripted_order():
    s = ShadowLru(5)
    s.evicted = []
    assert s.request(["a", "b"], ["a", "b", "c"], 1) == 0  # cold from index 1: b, c
    assert list(s.order) == ["c", "b", "a"]
    assert s.request(["a", "x"], ["a", "x", "y"], None) == 1  # a hit; x, y need 2 of the 2 free
    assert list(s.order) == ["c", "b", "y", "x", "a"]
    assert s.request(["z"], ["z"], None) == 0
    assert s.evicted == ["c"]
    assert list(s.order) == ["b", "y", "x", "a", "z"]


# -------------------------------------------------- store against simulator
def _drive_store(store: TieredStore, prompts: list[list[bytes]]) -> list[bytes]:
    """Run prompts one at a time as the engine does (a partial last block too); the keys evicted."""
    evicted: list[bytes] = []

    class Listener:
        def block_stored(self, block_id: int, key: bytes, digest: int | None) -> None:
            pass

        def block_removed(self, block_id: int, key: bytes) -> None:
            evicted.append(key)

    pool = store.block_pool
    pool.add_listener(Listener())
    for keys in prompts:
        lookup = keys[:-1]
        hit = store.load(lookup, store.match_prefix(lookup))
        cold_from = store.cold_from(lookup, len(hit))
        new = pool.allocate(len(keys) - len(hit) + 1)  # the new full blocks and the partial last one
        table = hit + new
        for i in range(len(hit), len(keys)):
            pool.register_key(table[i], keys[i], cold=cold_from is not None and i >= cold_from)
        pool.release(table)
        store.check_integrity()
    return evicted


def _simulate(policy: str, capacity: int, prompts: list[list[bytes]]) -> list[bytes]:
    sim = PolicySim(capacity, policy, epoch=20)
    sim.cache.evicted = []
    for keys in prompts:
        sim.request(keys[:-1], keys, num_unkeyed=1)
    return sim.cache.evicted


@pytest.mark.parametrize("policy", ["lru", "cold-tail"])
def test_store_evicts_exactly_what_the_simulator_evicts(policy):
    prompts = _script(7, 400)
    capacity = 24
    store = TieredStore(SPEC, TieredStoreConfig(num_device_blocks=capacity, device_policy=policy))
    if store.tail_cap is not None:
        store.tail_cap.epoch = 20
    got = _drive_store(store, prompts)
    want = _simulate(policy, capacity, prompts)
    assert len(want) > 500
    assert got == want
    if policy == "cold-tail":
        assert store.tail_cap is not None and store.tail_cap.tail_blocks is not None  # a cap was chosen


def test_store_cold_blocks_travel_cold_to_host_and_skip_disk(tmp_path):
    config = TieredStoreConfig(num_device_blocks=4, num_host_blocks=2, disk_path=str(tmp_path / "d"),
                               disk_capacity_bytes=1 << 24, watermark_blocks=0)
    store = TieredStore(SPEC, config)
    keys = chain(4)
    ids = store.block_pool.allocate(4)
    for i, (b, k) in enumerate(zip(ids, keys, strict=True)):
        store.device_pool[b].copy_(block_value(i))
        store.block_pool.register_key(b, k, cold=i >= 2)
    store.block_pool.release(ids)
    filler = store.block_pool.allocate(4)  # evicts keys 3, 2 (cold, tail first), then 1, 0
    assert store.host is not None and store.disk is not None
    # keys 3, 2 went to host cold; 1 then 0 pushed them out: cold blocks are not written to disk.
    assert store.host.keys_lru_first() == [keys[1], keys[0]]
    store.flush()
    assert [store.disk.contains(k) for k in keys] == [False, False, False, False]
    store.block_pool.release(filler)
    store.check_integrity()
    store.close()


def test_watermark_precopies_cold_blocks_only_into_free_host_slots():
    """A cold block pre-copied into a full cold-tail host would be pushed out by the next pre-copy:
    cold blocks are pre-copied while free host slots last, hot ones always."""
    def cached_store(cold_from: int) -> TieredStore:
        store = TieredStore(SPEC, TieredStoreConfig(num_device_blocks=8, num_host_blocks=3, watermark_blocks=4))
        assert store.host is not None
        for i, k in enumerate(chain(2, first_token=5000)):  # 2 of 3 host slots hold ordinary keys
            assert store.host.put(k, block_value(i))
        ids = store.block_pool.allocate(8)
        for i, (b, k) in enumerate(zip(ids, chain(8), strict=True)):
            store.block_pool.register_key(b, k, cold=i >= cold_from)
        store.block_pool.release(ids)
        return store

    store = cached_store(cold_from=2)  # the 4 coldest cached blocks (7, 6, 5, 4) are cold
    assert store.maintain_watermark() == 1  # one free host slot: one cold block copied
    assert store.maintain_watermark() == 0  # and no churn on the next steps
    assert store.maintain_watermark() == 0
    store.check_integrity()
    hot = cached_store(cold_from=8)
    assert hot.maintain_watermark() == 4  # ordinary blocks are copied as before, pushing host keys out
    hot.check_integrity()


def test_preempted_sequences_release_their_tail_warm(tiny_model_dir):
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams

    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=16),
                    store_config=TieredStoreConfig(num_device_blocks=16))
    assert eng.store.tail_cap is not None
    eng.store.tail_cap.tail_blocks = 1
    eng.add_request("r", list(range(3, 3 + 4 * 16 + 3)), SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # prefill: 4 full blocks keyed, 1..3 cold
    [seq] = eng.scheduler.running
    table = list(seq.block_table)
    assert [eng.pool.is_cold(b) for b in table[:4]] == [False, True, True, True]
    eng.scheduler.preempt(seq)
    assert [eng.pool.is_cold(b) for b in table[:4]] == [False, False, False, False]
    assert seq.tail_scored
    eng.check_integrity()
    eng.close()


def test_yaml_policy_of_an_absent_tier_is_an_error(tmp_path):
    raw = yaml.safe_load("model: {path: m}\nkvstore: {block_size_tokens: 4, device: {bytes: 1MiB}, "
                         "host: {policy: lru}}")
    with pytest.raises(ConfigError, match=r"kvstore\.host\.policy: there is no host tier; set kvstore\.host\.bytes"):
        parse_config(raw, base_dir=tmp_path)
    raw["kvstore"]["host"] = None
    raw["kvstore"]["disk"] = {"policy": "lru"}
    with pytest.raises(ConfigError, match=r"kvstore\.disk\.policy: there is no disk tier"):
        parse_config(raw, base_dir=tmp_path)
