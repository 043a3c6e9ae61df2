"""InfiniGen with speculative selection (issue 17, `engine.infinigen_speculative`): the partial key cache, the
prefetch of speculated tokens into staging rows (their bytes are the offloaded bytes, in token order), the
overlap on a prefetch thread, the NIXL row path, the config, and exactness when nothing is offloaded."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.infinigen_speculative import SPECULATE_FROM, select_rows
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.skew import compute_skew, partial_keys
from kvrelay.model.tiny import write_tiny_model
from kvrelay.transfer.node_agent import make_agent

BS = 16
SPEC_SMALL = LongContextConfig("infinigen", device_budget_tokens=96, sink_tokens=16, recent_tokens=32,
                               recall_blocks=2, selection="speculative")


@pytest.fixture(scope="module")
def model4_dir(tmp_path_factory):
    """A 4-layer tiny model: layers 2 and 3 are speculated (from layers 1 and 2), 0 and 1 are not."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny4") / "model", seed=0, layers=4)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(258) for _ in range(length + 7 * i)] for i in range(n)]


def _engine(loaded, *, host_blocks: int = 64) -> LLMEngine:
    """An engine with a host tier and skew tables fitted to a random prompt (the test model has no tokenizer)."""
    eng = LLMEngine(loaded, EngineConfig(num_blocks=96), store_config=TieredStoreConfig(
        num_device_blocks=96, num_host_blocks=host_blocks, watermark_blocks=0))
    eng.use_skew(compute_skew(loaded, _prompts(1, 200, seed=9)[0], partial_frac=0.25))
    return eng


def _generate(eng: LLMEngine, prompts, params, policy) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params, long_context=policy)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        eng.check_integrity()
    return [out[f"r{i}"] for i in range(len(prompts))]


def _baseline(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert eng.pool.stats().num_in_use == 0 and eng.store.host.num_reserved == 0 and not eng.policies._states


def test_selection_prefers_tokens_within_alpha_then_staged_ones_then_the_rest_by_score() -> None:
    inf = float("-inf")
    score = torch.tensor([[1.0, 2.5, 3.0, 9.0, 2.0, 8.5],  # row 0: T 6, C 3, alpha 1: 3 and 5 must come
                          [7.0, 7.5, 1.0, 0.0, inf, inf]])  # row 1: T 4, C 2, alpha 0.2: only 1 must come
    held = torch.tensor([[1, -1, -1],  # row 0 holds token 1: it stays, over token 2's higher score
                         [2, 0, -1]])  # row 1 holds 2 then 0: token 0 (7.0) stays over token 2 (1.0)
    chosen, src = select_rows(score, held, torch.tensor([3, 2]), torch.tensor([[1.0], [0.2]]))
    assert chosen.tolist() == [[1, 3, 5], [0, 1, 6]]  # ascending; row 1 padded with Tmax
    assert src.tolist() == [[0, -1, -1], [1, -1, -1]]  # token 1 in row 0's staging row 0, token 0 in row 1's 1
    # every token within alpha, more than fit: the best scores win (a float32 rank would tie them all)
    chosen, _ = select_rows(torch.tensor([[1.0, 5.0, 3.0, 9.0]]), torch.tensor([[-1, -1]]), torch.tensor([2]),
                            torch.tensor([[100.0]]))
    assert chosen.tolist() == [[1, 3]]


def test_batched_selection_equals_one_row_at_a_time() -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [(40, 16), (64, 32), (17, 16), (33, 8)]  # (T_i, C_i)
    tmax, cmax = max(t for t, _ in sizes), max(c for _, c in sizes)
    score = torch.full((len(sizes), tmax), float("-inf"))
    held = torch.full((len(sizes), cmax), -1, dtype=torch.int64)
    for i, (t, c) in enumerate(sizes):
        score[i, :t] = torch.randn(t, generator=gen) * 3
        held[i, : c // 2] = torch.randperm(t, generator=gen)[: c // 2]
    caps = torch.tensor([c for _, c in sizes])
    alpha = torch.tensor([[1.0], [2.0], [0.5], [4.0]])
    chosen, src = select_rows(score, held, caps, alpha)
    for i, (t, c) in enumerate(sizes):
        one_chosen, one_src = select_rows(score[i : i + 1, :t], held[i : i + 1, :c], caps[i : i + 1], alpha[i : i + 1])
        assert chosen[i, :c].tolist() == one_chosen[0].tolist() and src[i, :c].tolist() == one_src[0].tolist()
        assert (chosen[i, c:] == tmax).all()


def test_config_fields_are_checked_and_requests_cannot_set_the_channel_fraction() -> None:
    with pytest.raises(ValueError, match=r"long_context.selection: 'tokens' is not one of blocks, speculative"):
        LongContextConfig("infinigen", selection="tokens")
    with pytest.raises(ValueError, match=r"long_context.speculation_alpha: must be a finite number >= 0"):
        LongContextConfig("infinigen", speculation_alpha=-1.0)
    with pytest.raises(ValueError, match=r"long_context.partial_channels_frac: must be in \(0, 1\]"):
        LongContextConfig("infinigen", partial_channels_frac=0.0)
    base = LongContextConfig("infinigen", partial_channels_frac=0.3)
    got = base.with_overrides({"selection": "speculative", "speculation_alpha": 2.5})
    assert (got.speculative, got.speculation_alpha, got.partial_channels_frac) == (True, 2.5, 0.3)
    with pytest.raises(ValueError, match="long_context: unknown field 'partial_channels_frac'"):
        base.with_overrides({"partial_channels_frac": 0.5})
    assert not LongContextConfig("h2o", selection="speculative").speculative


def test_prefetched_rows_are_the_offloaded_bytes_in_token_order(model4_dir) -> None:
    """After each step, every layer's staging rows hold exactly the host rows of the tokens it staged, sorted;
    the partial key cache holds the partial keys of every offloaded token's offloaded key."""
    loaded = load_model(model4_dir)
    eng = _engine(loaded)
    tables = eng.policies.speculative.speculation.tables
    for i, p in enumerate(_prompts(2, 120, seed=3)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True), long_context=SPEC_SMALL)
    checked = 0
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:
            st = eng.policies.state_of(seq)
            if st is None or not st.host_slots or not st.staged_tokens or int(st.staged_tokens[0].min()) < 0:
                continue
            host = eng.store.host.pool
            off = torch.cat([host[s] for s in st.host_slots], dim=3)  # [L, 2, Hkv, T_off, D]
            staged = torch.cat([eng.kv_pool[b] for b in st.staging], dim=3)  # [L, 2, Hkv, C, D]
            for layer in range(eng.spec.num_layers):
                tokens = st.staged_tokens[layer]
                assert torch.equal(tokens, tokens.sort().values) and tokens.unique().numel() == tokens.numel()
                assert torch.equal(staged[layer], off[layer][:, :, tokens])
                want_pk = partial_keys(tables, layer, off[layer, 0].transpose(0, 1))
                torch.testing.assert_close(st.partial_keys[layer], want_pk, rtol=0, atol=1e-5)
            checked += 1
    assert checked >= 4
    assert eng.policies.stats.recalled_token_rows > 0 and eng.policies.stats.recalled_layer_blocks == 0
    _baseline(eng)


def test_later_layers_prefetch_on_the_prefetch_thread(model4_dir) -> None:
    loaded = load_model(model4_dir)
    eng = _engine(loaded)
    owner = eng.policies
    copy = owner.copy_rows
    where: dict[int, set[str]] = {}

    def recording(*args, layer, **kwargs):
        where.setdefault(layer, set()).add(threading.current_thread().name.split("_")[0])
        return copy(*args, layer=layer, **kwargs)

    owner.copy_rows = recording
    _generate(eng, _prompts(1, 130, seed=5), SamplingParams(max_tokens=12, ignore_eos=True), SPEC_SMALL)
    assert set(where) == set(range(eng.spec.num_layers))
    assert eng.spec.num_layers == 4
    for layer, threads in where.items():
        assert threads == ({"MainThread"} if layer < SPECULATE_FROM else {"kvrelay-prefetch"}), (layer, threads)


def test_budget_above_length_equals_none_exactly(model4_dir) -> None:
    loaded = load_model(model4_dir)
    prompts = _prompts(2, 90, seed=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = LLMEngine(loaded, EngineConfig(num_blocks=96)).generate(prompts, params)
    big = LongContextConfig("infinigen", device_budget_tokens=512, sink_tokens=16, recent_tokens=32,
                            recall_blocks=2, selection="speculative")
    eng = _engine(loaded)
    assert _generate(eng, prompts, params, big) == [o[0] for o in want]
    assert eng.policies.stats.offloaded_blocks == 0
    _baseline(eng)


def test_token_rows_move_through_nixl_and_the_engine_uses_that_path(model4_dir) -> None:
    loaded = load_model(model4_dir)
    eng = _engine(loaded)
    agent = make_agent(eng, "spec-rows")
    try:
        host = eng.store.host.pool
        saved = host.clone()
        host.copy_(torch.randn(host.shape, generator=torch.Generator().manual_seed(0)).to(host.dtype))
        before = eng.kv_pool.clone()
        layers = eng.spec.num_layers
        assert agent.local_copy("host", [2, 1], "device", [5, 3], layers=[layers - 1, 0],
                                rows=([7, 0], [15, 4])) == "nixl"
        want = before.clone()
        want[5, layers - 1, :, :, 15] = host[2, layers - 1, :, :, 7]
        want[3, 0, :, :, 4] = host[1, 0, :, :, 0]
        assert torch.equal(eng.kv_pool, want)
        with pytest.raises(ValueError, match=r"rows needs layers and one \(src, dst\) row in \[0, 16\)"):
            agent.local_copy("host", [0], "device", [0], layers=[0], rows=([16], [0]))
        host.copy_(saved)
        eng.kv_pool.copy_(before)
        local_copy, row_paths = eng.store.local_copy, []

        def recording(*args, rows=None, **kwargs):
            path = local_copy(*args, rows=rows, **kwargs)
            if rows is not None:
                row_paths.append(path)
            return path

        eng.store.local_copy = recording
        _generate(eng, _prompts(1, 130, seed=4), SamplingParams(max_tokens=10, ignore_eos=True), SPEC_SMALL)
        assert eng.policies.stats.recalled_token_rows > 0 and eng.policies.stats.copy_fallbacks == 0
        assert row_paths and set(row_paths) == {"nixl"}
        _baseline(eng)
    finally:
        agent.close()


def _integrity_engine(loaded, integrity: str) -> LLMEngine:
    eng = LLMEngine(loaded, EngineConfig(num_blocks=96), store_config=TieredStoreConfig(
        num_device_blocks=96, num_host_blocks=64, watermark_blocks=0, integrity=integrity))
    eng.use_skew(compute_skew(loaded, _prompts(1, 200, seed=9)[0], partial_frac=0.25))
    return eng


def _run_corrupting(eng: LLMEngine, prompts, params) -> tuple[list[list[int]], list[str], int]:
    """Generate; right after ``r0``'s first offload (nothing staged yet, so its next step fetches every
    staging row from the host), overwrite layer 0 of all its host slots. Returns the tokens and the request
    ids that got a token in the step after, and how many tokens ``r0`` had then."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params, long_context=SPEC_SMALL)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    after: list[str] | None = None
    corrupted = False
    while eng.has_unfinished():
        outs = eng.step()
        for o in outs:
            out[o.request_id].extend(o.new_token_ids)
        if corrupted and after is None:
            after = sorted(o.request_id for o in outs)
        seq = next((s for s in eng.scheduler.running if s.request_id == "r0"), None)
        st = None if seq is None else eng.policies.state_of(seq)
        if not corrupted and st is not None and st.host_slots:
            assert int(st.staged_tokens[0].max()) == -1, "nothing staged before the first recall"
            for slot in st.host_slots:
                eng.store.host.pool[slot, 0] = 50.0
            corrupted = True
            before = len(out["r0"])
        eng.check_integrity()
    assert corrupted and after is not None, "r0 never offloaded: the test checks nothing"
    return [out[f"r{i}"] for i in range(len(prompts))], after, before


def test_a_corrupt_prefetch_is_never_served_and_the_sequence_is_recomputed(model4_dir) -> None:
    loaded = load_model(model4_dir)
    prompts = _prompts(2, 100, seed=6)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    clean = _generate(_integrity_engine(loaded, "all"), prompts, params, SPEC_SMALL)
    eng = _integrity_engine(loaded, "all")
    tokens, after, before = _run_corrupting(eng, prompts, params)
    assert after == ["r1"]  # r0's token of the corrupt step was dropped
    # r0 is recomputed from its tokens and goes on; what it stages after that depends on its history, so
    # only the tokens before the corruption are pinned
    assert tokens[1] == clean[1] and tokens[0][:before] == clean[0][:before] and before >= 1
    assert len(tokens[0]) == len(clean[0])
    assert eng.stats.preemptions == 1
    failures = eng.store.metrics.registry.get_sample_value("kvrelay_kv_integrity_failures_total",
                                                           {"where": "recall"})
    assert failures is not None and failures >= 1
    _baseline(eng)
    control = _integrity_engine(loaded, "off")
    served, after, _ = _run_corrupting(control, prompts, params)
    assert after == ["r0", "r1"] and served[0] != clean[0] and served[1] == clean[1]
