"""InfiniGen recall integrity (issue #16): every recalled layer slice is checked against the digest taken
at offload; a corrupt one is never served — the step's token is dropped and the sequence recomputed."""

from __future__ import annotations

import random

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams

# 8 blocks of 16: 1 sink + 4 staging + 2 recent + 1. Offloading starts past 4 blocks of KV, and below 128
# tokens a sequence has at most 4 offloaded blocks, so every one is recalled: exact full attention.
FULL_RECALL = LongContextConfig("infinigen", device_budget_tokens=128, sink_tokens=16, recent_tokens=32,
                                recall_blocks=4)
PARAMS = SamplingParams(max_tokens=27, ignore_eos=True)  # 100 + 27 tokens: at most 127 of KV
CORRUPT_LAYER = 1
CORRUPT_VALUE = 50.0  # large enough that attention at the corrupt rows changes the greedy tokens


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(258) for _ in range(n)] for n in (100, 90)]


def _engine(loaded, policy: LongContextConfig = FULL_RECALL, *, integrity: str = "all",
            rate: float = 0.1) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=96, long_context=policy),
                     store_config=TieredStoreConfig(num_device_blocks=96, num_host_blocks=64, watermark_blocks=0,
                                                    integrity=integrity, integrity_sample_rate=rate))


def _metric(eng: LLMEngine, name: str) -> float:
    return eng.store.metrics.registry.get_sample_value(name, {"where": "recall"}) or 0.0


def _generate_corrupting(eng: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict]]:
    """Generate step by step. Once request ``r0`` has 4 offloaded blocks (mid-generation: its 4th is
    offloaded after ~12 decode steps), overwrite layer ``CORRUPT_LAYER`` of its newest host slot — not yet
    recalled — with ``CORRUPT_VALUE``, once. Returns the tokens per request, and for the step after the
    corruption: its outputs' request ids and the failure count after it."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, PARAMS)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    corrupted_slot: int | None = None
    after: list[dict] = []
    while eng.has_unfinished():
        outs = eng.step()
        for o in outs:
            out[o.request_id].extend(o.new_token_ids)
        if corrupted_slot is not None and not after:
            after.append({"outputs": sorted(o.request_id for o in outs),
                          "failures": _metric(eng, "kvrelay_kv_integrity_failures_total")})
        eng.check_integrity()
        seq = next((s for s in eng.scheduler.running if s.request_id == "r0"), None)
        state = None if seq is None else eng.policies.state_of(seq)
        if state is not None:
            assert len(state.slice_digests) == (len(state.host_slots) if eng.store.integrity.enabled else 0)
        if corrupted_slot is None and state is not None and len(state.host_slots) == 4:
            assert state.staged[CORRUPT_LAYER][3] == -1, "the newest offloaded block is not recalled yet"
            corrupted_slot = state.host_slots[3]
            eng.store.host.pool[corrupted_slot, CORRUPT_LAYER] = CORRUPT_VALUE
            assert len(out["r0"]) > 1, "corrupt mid-generation"
    assert corrupted_slot is not None, "r0 never offloaded 4 blocks: the test checks nothing"
    return [out[rid] for rid in ids], after


def _assert_baseline(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert eng.pool.stats().num_in_use == 0
    assert eng.store.host.num_reserved == 0
    assert not eng.policies._states


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(loaded) -> list[list[int]]:
    """Full attention's greedy tokens (the full-recall InfiniGen engine gives the same)."""
    return [o[0] for o in _engine(loaded, LongContextConfig()).generate(_prompts(), PARAMS)]


def test_full_recall_is_exact_and_checks_every_recalled_slice(loaded, reference):
    eng = _engine(loaded)
    assert [o[0] for o in eng.generate(_prompts(), PARAMS)] == reference
    stats = eng.policies.stats
    assert stats.offloaded_blocks == 8 and stats.recalled_layer_blocks == 16  # 4 blocks × 2 layers, per request
    assert _metric(eng, "kvrelay_kv_integrity_checks_total") == 16
    assert _metric(eng, "kvrelay_kv_integrity_failures_total") == 0
    assert eng.stats.preemptions == 0
    _assert_baseline(eng)


@pytest.mark.parametrize(("integrity", "rate"), [("all", 0.1), ("sampled", 1.0)])
def test_a_corrupt_recall_is_never_served_and_the_sequence_is_recomputed(loaded, reference, integrity, rate):
    eng = _engine(loaded, integrity=integrity, rate=rate)
    tokens, [after] = _generate_corrupting(eng, _prompts())
    assert tokens == reference
    # the step that recalled the corrupt slice streamed r1's token and dropped r0's
    assert after == {"outputs": ["r1"], "failures": 1.0}
    assert _metric(eng, "kvrelay_kv_integrity_failures_total") == 1
    assert eng.stats.preemptions == 1  # r0 alone, recomputed from its tokens
    stats = eng.policies.stats
    # r0 recalls its 4 offloaded blocks (2 layers each) twice: before and after its recompute
    assert stats.recalled_layer_blocks == 16 + 8
    assert _metric(eng, "kvrelay_kv_integrity_checks_total") == stats.recalled_layer_blocks
    _assert_baseline(eng)


def test_with_integrity_off_the_corruption_is_served(loaded, reference):
    """The control: without the check, the same corruption changes r0's tokens (r1's stay exact)."""
    eng = _engine(loaded, integrity="off")
    tokens, [after] = _generate_corrupting(eng, _prompts())
    assert after == {"outputs": ["r0", "r1"], "failures": 0.0}
    assert tokens[1] == reference[1]
    assert len(tokens[0]) == len(reference[0]) and tokens[0] != reference[0]
    assert _metric(eng, "kvrelay_kv_integrity_checks_total") == 0
    assert eng.stats.preemptions == 0
    _assert_baseline(eng)


def test_partial_recall_checks_each_slice_against_its_own_offloaded_block(loaded):
    """With fewer staging blocks than offloaded ones, a staging block holds a different offloaded block in
    each layer and from step to step: every recalled slice still matches the digest of the block it is."""
    policy = LongContextConfig("infinigen", device_budget_tokens=96, sink_tokens=16, recent_tokens=32,
                               recall_blocks=2)
    eng = _engine(loaded, policy)
    eng.generate([[random.Random(3).randrange(258) for _ in range(200)]], SamplingParams(max_tokens=20))
    stats = eng.policies.stats
    assert stats.offloaded_blocks >= 8 and stats.recalled_layer_blocks > 2 * stats.offloaded_blocks
    assert _metric(eng, "kvrelay_kv_integrity_checks_total") == stats.recalled_layer_blocks
    assert _metric(eng, "kvrelay_kv_integrity_failures_total") == 0
    assert eng.stats.preemptions == 0
    _assert_baseline(eng)


def test_a_host_copy_that_keeps_going_bad_ends_in_full_attention_not_a_loop(loaded, reference):
    """Every offload of r0 is damaged before its recall: after the second failure r0 is recomputed without
    its policy (full attention on device) instead of offloading and failing forever."""
    eng = _engine(loaded)
    for rid, prompt in zip(("r0", "r1"), _prompts()):
        eng.add_request(rid, prompt, PARAMS)
    out: dict[str, list[int]] = {"r0": [], "r1": []}
    damaged: list[object] = []  # the policy states (one per incarnation of r0) whose offload was damaged
    steps = 0
    while eng.has_unfinished():
        steps += 1
        assert steps < 500, "r0 never finished"
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        seq = next((s for s in eng.scheduler.running if s.request_id == "r0"), None)
        state = None if seq is None else eng.policies.state_of(seq)
        if state is not None and len(state.host_slots) == 4 and all(d is not state for d in damaged):
            damaged.append(state)
            eng.store.host.pool[state.host_slots[3], CORRUPT_LAYER] = CORRUPT_VALUE
    assert [out["r0"], out["r1"]] == reference
    assert _metric(eng, "kvrelay_kv_integrity_failures_total") == 2 and eng.stats.preemptions == 2
    assert len(damaged) == 2  # the third incarnation of r0 had no policy: nothing was offloaded
    _assert_baseline(eng)
