"""Long-context policies in the engine: H2O eviction and InfiniGen-style offload and recall (docs/design.md §7)."""

from __future__ import annotations

import random

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kernels import reference
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.transfer.node_agent import make_agent

BS = 16
H2O_SMALL = LongContextConfig("h2o", device_budget_tokens=64, sink_tokens=16, recent_tokens=16)
INFINIGEN_SMALL = LongContextConfig("infinigen", device_budget_tokens=96, sink_tokens=16, recent_tokens=32,
                                    recall_blocks=2)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(258) for _ in range(length + 7 * i)] for i in range(n)]


FULL = LongContextConfig()


def _engine(loaded, policy: LongContextConfig = FULL, *, host_blocks: int = 64) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=96, long_context=policy),
                     store_config=TieredStoreConfig(num_device_blocks=96, num_host_blocks=host_blocks,
                                                    watermark_blocks=0))


def _assert_baseline(eng: LLMEngine) -> None:
    """No block in use, no host slot reserved, no policy state left."""
    eng.check_integrity()
    stats = eng.pool.stats()
    assert stats.num_in_use == 0, f"{stats.num_in_use} device blocks still in use"
    assert eng.store.host is None or eng.store.host.num_reserved == 0
    assert not eng.policies._states


def _run_checked(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                 policy: LongContextConfig) -> list[list[int]]:
    """Generate step by step; after every step each decoding sequence holds ≤ the budget's blocks."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    budget = policy.budget_blocks(BS)
    steps_over = 0
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        for seq in eng.scheduler.running:
            if seq.is_decode:
                assert len(seq.block_table) <= budget, (seq.request_id, len(seq.block_table), budget)
                steps_over += seq.num_absent_tokens > 0
        eng.check_integrity()
    assert steps_over > 0, "the budget never bound: the test checks nothing"
    return [out[rid] for rid in ids]


@pytest.mark.parametrize("policy", ["h2o", "infinigen"])
def test_budget_above_length_gives_the_tokens_of_full_attention(tiny_model_dir, policy):
    loaded = load_model(tiny_model_dir)
    prompts = _prompts(3, 90, seed=1)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = _engine(loaded).generate(prompts, params)
    cfg = LongContextConfig(policy, device_budget_tokens=512, sink_tokens=16, recent_tokens=32, recall_blocks=2)
    eng = _engine(loaded, cfg)
    assert eng.generate(prompts, params) == want
    assert eng.policies.stats.evicted_tokens == eng.policies.stats.offloaded_blocks == 0
    _assert_baseline(eng)


def test_h2o_keeps_the_budget_sink_and_recent_and_compacts_exactly(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    eng = _engine(loaded, H2O_SMALL)
    h2o = eng.policies.name_to_policy["h2o"]
    enforce = h2o.enforce
    checked = []

    def checked_enforce(seq, state):
        n = seq.num_kv_tokens
        before_rows = _rows(eng, seq.block_table, n)  # [L, 2, H, n, D]
        before_pos = state.positions[:, :, :n].clone()
        before_scores = state.scores[:, :, :n].clone()
        enforce(seq, state)
        m = seq.num_kv_tokens
        if m == n:
            return
        pos = state.positions[:, :, :m]
        sink, recent = H2O_SMALL.sink_tokens, H2O_SMALL.recent_tokens
        # sink and recent tokens are never evicted, in every layer and head
        assert torch.equal(pos[:, :, :sink], torch.arange(sink).expand_as(pos[:, :, :sink]))
        last = seq.num_computed_tokens
        assert torch.equal(pos[:, :, m - recent:], torch.arange(last - recent, last).expand_as(pos[:, :, m - recent:]))
        after_rows = _rows(eng, seq.block_table, m)
        for layer in range(pos.shape[0]):
            for head in range(pos.shape[1]):
                where = {int(p): i for i, p in enumerate(before_pos[layer, head])}
                idx = torch.tensor([where[int(p)] for p in pos[layer, head]])
                # each kept row holds exactly the KV it held before compaction
                assert torch.equal(after_rows[layer, :, head], before_rows[layer, :, head][:, idx])
                # every evicted middle row scored no higher than any kept middle row
                kept = set(idx.tolist())
                middle = range(sink, n - recent)
                dropped = [before_scores[layer, head, i] for i in middle if i not in kept]
                stayed = [before_scores[layer, head, i] for i in middle if i in kept]
                if dropped and stayed:
                    assert max(dropped) <= min(stayed)
        checked.append(n - m)

    h2o.enforce = checked_enforce
    prompts = _prompts(2, 100, seed=2)
    _run_checked(eng, prompts, SamplingParams(max_tokens=40, ignore_eos=True), H2O_SMALL)
    assert checked and eng.policies.stats.evicted_tokens == sum(checked)
    _assert_baseline(eng)


def _rows(eng: LLMEngine, table: list[int], n: int) -> torch.Tensor:
    kv = eng.kv_pool[torch.tensor(table[: -(-n // BS)])]
    return kv.permute(1, 2, 3, 0, 4, 5).reshape(kv.shape[1], 2, kv.shape[3], -1, kv.shape[-1])[:, :, :, :n].clone()


def test_infinigen_offloads_through_nixl_and_recalls_the_same_bytes(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    eng = _engine(loaded, INFINIGEN_SMALL)
    agent = make_agent(eng, "infinigen-test")
    owner = eng.policies
    copy = owner.copy_blocks
    offloaded: dict[int, torch.Tensor] = {}  # host slot → the device bytes it was given
    recalls = []

    def checked_copy(src_tier, src_ids, dst_tier, dst_ids, *, layers=None):
        if src_tier == "device":
            snap = {s: eng.kv_pool[d].clone() for d, s in zip(src_ids, dst_ids)}
        copy(src_tier, src_ids, dst_tier, dst_ids, layers=layers)
        if src_tier == "device":
            for s in dst_ids:
                assert torch.equal(eng.store.host.pool[s], snap[s])
                offloaded[s] = snap[s]
        else:
            for s, d, layer in zip(src_ids, dst_ids, layers):
                assert torch.equal(eng.kv_pool[d, layer], offloaded[s][layer])  # recalled bytes == offloaded bytes
                recalls.append((s, layer))

    owner.copy_blocks = checked_copy
    try:
        before = dict(eng.store.local_copy_paths)
        _run_checked(eng, _prompts(2, 120, seed=3), SamplingParams(max_tokens=24, ignore_eos=True), INFINIGEN_SMALL)
        assert owner.stats.offloaded_blocks >= 8 and len(recalls) == owner.stats.recalled_layer_blocks > 0
        assert before == eng.store.local_copy_paths  # whole-block moves of the store untouched
        _assert_baseline(eng)
    finally:
        agent.close()


def test_infinigen_attention_over_recalled_blocks_equals_masked_reference(tiny_model_dir):
    """After a step, the last layer's staging blocks hold what its query picked: attention over the
    device table equals reference attention over the full KV with everything else masked out."""
    loaded = load_model(tiny_model_dir)
    eng = _engine(loaded, INFINIGEN_SMALL)
    policy = eng.policies.name_to_policy["infinigen"]
    last = eng.spec.num_layers - 1
    seen: dict[str, torch.Tensor] = {}
    before_decode = policy.before_decode

    def capture(layer, rows, q):
        before_decode(layer, rows, q)
        if layer == last:
            for r in rows:
                seen[r.seq.request_id] = q[r.row].clone()

    policy.before_decode = capture
    eng.add_request("a", _prompts(1, 200, seed=4)[0], SamplingParams(max_tokens=20, ignore_eos=True))
    compared = 0
    while eng.has_unfinished():
        seen.clear()
        eng.step()
        for seq in list(eng.scheduler.running):
            state = eng.policies.state_of(seq)
            if seq.request_id not in seen or state is None or not state.host_slots:
                continue
            q = seen[seq.request_id]
            n = seq.num_kv_tokens  # the step's token is committed: its KV row is n - 1
            cache = eng.kv_pool[:, last]
            got = reference.paged_decode_attention(
                q[None], cache[:, 0], cache[:, 1], torch.tensor([seq.block_table]), torch.tensor([n]),
                scale=eng.model_config.head_dim ** -0.5)[0]
            full_k, full_v = _full_kv(eng, seq, state, last)
            chosen = eng.policies.name_to_policy["infinigen"].positions(seq, state, last, n)[0]
            assert len(set(chosen.tolist())) == n
            mask = torch.full((full_k.shape[0],), float("-inf"))
            mask[chosen] = 0.0
            group = q.shape[0] // full_k.shape[1]
            k = full_k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
            v = full_v.float().repeat_interleave(group, dim=1)
            logits = torch.einsum("hd,shd->hs", q.float(), k) * eng.model_config.head_dim ** -0.5 + mask
            want = torch.einsum("hs,shd->hd", torch.softmax(logits, dim=-1), v)
            torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-5)
            compared += 1
    assert compared >= 5
    _assert_baseline(eng)


def _full_kv(eng: LLMEngine, seq, state, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's whole KV at ``layer`` in token order: sink and recent blocks from device, the
    offloaded ones from host. ``[num_computed_tokens, H, D]`` each."""
    host = eng.store.host.pool
    sink = [eng.kv_pool[b, layer] for b in seq.block_table[: state.num_sink_blocks]]
    off = [host[s, layer] for s in state.host_slots]
    recent = [eng.kv_pool[b, layer] for b in seq.block_table[state.num_sink_blocks + len(state.staging):]]
    blocks = torch.stack(sink + off + recent)  # [nb, 2, H, B, D]
    kv = blocks.permute(1, 0, 3, 2, 4).reshape(2, -1, blocks.shape[2], blocks.shape[-1])
    return kv[0, : seq.num_computed_tokens], kv[1, : seq.num_computed_tokens]


@pytest.mark.parametrize("policy", [H2O_SMALL, INFINIGEN_SMALL], ids=["h2o", "infinigen"])
def test_forked_samples_keep_the_budget_from_their_first_decode_step(tiny_model_dir, policy):
    eng = _engine(load_model(tiny_model_dir), policy)
    params = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=7, ignore_eos=True)
    [out] = _run_checked(eng, _prompts(1, 110, seed=5), params, policy)
    assert len(out) == 3 * 8  # the three samples' tokens
    _assert_baseline(eng)


@pytest.mark.parametrize("policy", [H2O_SMALL, INFINIGEN_SMALL], ids=["h2o", "infinigen"])
def test_a_full_pool_defers_the_policy_instead_of_failing(tiny_model_dir, policy):
    """Shared blocks free nothing when released: with every block taken, H2O cannot copy a shared block
    and InfiniGen gets fewer staging blocks; the step goes on and nothing leaks."""
    loaded = load_model(tiny_model_dir)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=11, long_context=policy),
                    store_config=TieredStoreConfig(num_device_blocks=11, num_host_blocks=32, watermark_blocks=0))
    out = eng.generate(_prompts(1, 150, seed=9), SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1,
                                                                ignore_eos=True))
    assert [len(o) for o in out[0]] == [6, 6]
    _assert_baseline(eng)


def test_a_failed_loopback_copy_is_redone_with_torch(tiny_model_dir):
    eng = _engine(load_model(tiny_model_dir), INFINIGEN_SMALL)
    calls = []

    def broken_local_copy(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("loopback copy timed out")

    eng.store.local_copy = broken_local_copy
    prompts = _prompts(1, 120, seed=3)
    want = _engine(load_model(tiny_model_dir), INFINIGEN_SMALL).generate(prompts, SamplingParams(max_tokens=8))
    assert eng.generate(prompts, SamplingParams(max_tokens=8)) == want
    assert eng.policies.stats.copy_fallbacks == len(calls) > 0
    _assert_baseline(eng)


def test_preemption_gives_offloaded_kv_back(tiny_model_dir):
    eng2 = _engine(load_model(tiny_model_dir), INFINIGEN_SMALL)
    eng2.add_request("p", _prompts(1, 120, seed=6)[0], SamplingParams(max_tokens=16, ignore_eos=True))
    for _ in range(4):
        eng2.step()
    [seq] = eng2.scheduler.running
    assert eng2.policies.state_of(seq).host_slots
    eng2.scheduler.preempt(seq)  # recompute later: offloaded KV is given back now
    assert eng2.store.host.num_reserved == 0 and eng2.policies.state_of(seq) is None
    while eng2.has_unfinished():
        eng2.step()
    _assert_baseline(eng2)


def test_bad_policies_are_refused_naming_the_problem(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=32))  # no host tier
    with pytest.raises(RequestError, match="infinigen offloads to the host tier"):
        eng.add_request("x", [1, 2, 3], SamplingParams(), long_context=INFINIGEN_SMALL)
    with pytest.raises(RequestError, match="raise device_budget_tokens to at least 48"):
        eng.add_request("y", [1, 2, 3], SamplingParams(),
                        long_context=LongContextConfig("h2o", device_budget_tokens=32, sink_tokens=16,
                                                       recent_tokens=16))
    with pytest.raises(ValueError, match="long_context.policy: 'lru' is not one of"):
        LongContextConfig("lru")
    with pytest.raises(ValueError, match="unknown field"):
        H2O_SMALL.with_overrides({"budget": 3})
    assert not eng.has_unfinished()
    _assert_baseline(eng)
