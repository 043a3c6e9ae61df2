"""Engine: HF parity, batch invariance, prefix reuse, n > 1 with copy-on-write, preemption, bad input."""

from __future__ import annotations

import random

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams

from tests.hf_models import HF_CONFIGS

GREEDY64 = SamplingParams(max_tokens=64)


def prompts_for(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_greedy_generation_equals_transformers(hf_model_dir, name):
    from transformers import AutoModelForCausalLM

    path = hf_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = LLMEngine(load_model(path), EngineConfig(num_blocks=128))
    prompts = prompts_for(300, (1, 16, 17, 300))
    ours = engine.generate(prompts, GREEDY64)
    for prompt, [out] in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
        assert out == ref, f"{name}, prompt length {len(prompt)}"
    assert len({tuple(o[0]) for o in ours}) == len(prompts)
    engine.check_integrity()
    assert engine.pool.stats().num_in_use == 0


def test_batch_invariance_with_staggered_arrivals(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompts = prompts_for(258, (5, 40, 16, 70, 33, 2))
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=20, temperature=0.8, seed=3),
              SamplingParams(max_tokens=7), SamplingParams(max_tokens=15, top_k=5, temperature=1.0, seed=9),
              SamplingParams(max_tokens=9, top_p=0.7, temperature=1.2, seed=1), SamplingParams(max_tokens=11)]
    alone = []
    for p, sp in zip(prompts, params):
        eng = LLMEngine(loaded, EngineConfig(num_blocks=64, enable_prefix_caching=False))
        alone.append(eng.generate([p], sp)[0][0])
    # One engine; a small token budget forces chunked prefill mixed with decodes.
    eng = LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_batched_tokens=24, enable_prefix_caching=False))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]}
    step = 0
    while step <= max(arrivals) or eng.has_unfinished():
        for i in arrivals.get(step, []):
            eng.add_request(f"r{i}", prompts[i], params[i])
        for out in eng.step():
            got[out.request_id].extend(out.new_token_ids)
        eng.check_integrity()
        step += 1
    assert [got[f"r{i}"] for i in range(len(prompts))] == alone


def test_prefix_reuse_counts_exact_blocks_and_salt_isolates(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    shared = prompts_for(258, (80,), seed=5)[0]  # exactly 5 blocks of 16
    first = shared + [7, 8, 9]
    second = shared + [11, 12, 13, 14]
    cold = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([second], SamplingParams(max_tokens=10))[0][0]

    eng = LLMEngine(loaded, EngineConfig(num_blocks=64))
    eng.generate([first], SamplingParams(max_tokens=4))
    cached_ids = [eng.pool.block_id_of(k) for k in _keys(eng, first)[:5]]
    assert None not in cached_ids
    computed_before = eng.stats.computed_prefill_tokens
    eng.add_request("second", second, SamplingParams(max_tokens=10))
    eng.step()
    seq = eng._requests["second"].seqs[0]
    assert seq.num_cached_prompt_tokens == 80
    assert seq.block_table[:5] == cached_ids
    assert [eng.pool.ref_count(b) for b in cached_ids] == [1] * 5
    assert eng.stats.computed_prefill_tokens - computed_before == 4
    while eng.has_unfinished():
        eng.step()
    assert seq.output_token_ids == cold

    hits_before = eng.scheduler.num_prefix_hit_tokens
    [[salted]] = eng.generate([second], SamplingParams(max_tokens=10), salt=b"tenant-b")
    assert eng.scheduler.num_prefix_hit_tokens == hits_before
    assert salted == cold
    eng.check_integrity()


def test_prompts_sharing_an_inflight_prefix_wait_for_it(tiny_model_dir):
    """A and B share 3 blocks and arrive together: B waits one step (C, a stranger, goes first), then
    reads A's 3 blocks from the prefix cache instead of computing them again."""
    loaded = load_model(tiny_model_dir)
    shared = prompts_for(258, (48,), seed=6)[0]  # exactly 3 blocks of 16
    a, b = shared + [5, 6], shared + [7, 8, 9]
    c = prompts_for(258, (20,), seed=7)[0]
    alone = {name: LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([p], SamplingParams(max_tokens=6))[0][0]
             for name, p in (("a", a), ("b", b), ("c", c))}
    eng = LLMEngine(loaded, EngineConfig(num_blocks=64))
    for name, prompt in (("a", a), ("b", b), ("c", c)):
        eng.add_request(name, prompt, SamplingParams(max_tokens=6))
    eng.step()
    assert [s.seq_id for s in eng.scheduler.running] == [0, 2] and eng.stats.computed_prefill_tokens == 50 + 20
    assert [s.seq_id for s in eng.scheduler.waiting] == [1]
    eng.step()
    seq_b = eng._requests["b"].seqs[0]
    assert seq_b.num_cached_prompt_tokens == 48 and eng.stats.computed_prefill_tokens == 70 + 3
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for name in got:
        got[name] = list(eng._requests[name].seqs[0].output_token_ids)
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id].extend(out.new_token_ids)
    assert got == alone
    eng.check_integrity()


def _keys(engine: LLMEngine, tokens: list[int]) -> list[bytes]:
    from kvrelay.kvstore.block_key import block_keys

    return block_keys(tokens, block_size_tokens=engine.spec.block_size_tokens, spec_fingerprint=engine.spec.fingerprint)


def test_whole_prompt_cached_still_computes_last_token(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompt = prompts_for(258, (32,), seed=8)[0]
    eng = LLMEngine(loaded, EngineConfig(num_blocks=32))
    [[a]] = eng.generate([prompt], SamplingParams(max_tokens=6))
    before = eng.stats.computed_prefill_tokens
    [[b]] = eng.generate([prompt], SamplingParams(max_tokens=6))
    assert a == b
    assert eng.stats.computed_prefill_tokens - before == 16  # block 0 reused, block 1 recomputed


@pytest.mark.parametrize("prompt_len", [20, 32])
def test_n_samples_share_prompt_blocks_and_match_single_runs(tiny_model_dir, prompt_len):
    loaded = load_model(tiny_model_dir)
    prompt, other = prompts_for(258, (prompt_len, 23), seed=2)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=40, n=3)
    # Reference: the same request in a fresh engine, busy with another request at the same time.
    ref_engine = LLMEngine(loaded, EngineConfig(num_blocks=32))
    [ref, _] = ref_engine.generate([prompt, other], [params, SamplingParams(max_tokens=5)])
    [[first]] = LLMEngine(loaded, EngineConfig(num_blocks=32)).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=40))
    assert ref[0] == first  # sample 0 of n is the n = 1 stream
    assert len({tuple(r) for r in ref}) == 3

    eng = LLMEngine(loaded, EngineConfig(num_blocks=32))
    eng.add_request("n3", prompt, params)
    eng.step()  # prefill + fork
    seqs = eng._requests["n3"].seqs
    assert len(seqs) == 3
    assert len({tuple(s.block_table) for s in seqs}) == 1
    assert [eng.pool.ref_count(b) for b in seqs[0].block_table] == [3] * len(seqs[0].block_table)
    eng.check_integrity()
    eng.step()  # first decode: each sample writes its own tail block
    tails = [s.block_table[prompt_len // 16] for s in seqs]
    assert len(set(tails)) == 3 and [eng.pool.ref_count(b) for b in tails] == [1, 1, 1]
    full = prompt_len // 16
    assert [eng.pool.ref_count(b) for b in seqs[0].block_table[:full]] == [3] * full
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    assert [s.output_token_ids for s in seqs] == ref
    assert eng.pool.stats().num_in_use == 0


def test_preemption_by_recompute_keeps_outputs(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompts = prompts_for(258, (30, 30, 30, 30), seed=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=11)
    ref = [LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([p], params)[0][0] for p in prompts]
    eng = LLMEngine(loaded, EngineConfig(num_blocks=12))  # 4 × 5 blocks needed at the end: must preempt
    outs = eng.generate(prompts, params)
    assert eng.stats.preemptions > 0
    assert [o[0] for o in outs] == ref
    eng.check_integrity()
    assert eng.pool.stats().num_in_use == 0


def test_stop_tokens_and_max_tokens(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompt = prompts_for(258, (9,), seed=3)[0]
    eng = LLMEngine(loaded, EngineConfig(num_blocks=16))
    [[full]] = eng.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    stop_at = full[5]
    [[cut]] = eng.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=(stop_at,), ignore_eos=True))
    assert cut == full[: full.index(stop_at) + 1]
    [[short]] = eng.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    assert short == full[:3]


def test_bad_prompts_are_refused_with_named_problem(tiny_model_dir):
    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=16, max_model_len=128))
    with pytest.raises(RequestError, match="prompt is empty"):
        eng.add_request("a", [], SamplingParams())
    with pytest.raises(RequestError, match=r"token id 258 at position 1 is outside the vocabulary \[0, 258\)"):
        eng.add_request("b", [1, 258], SamplingParams())
    with pytest.raises(RequestError, match="prompt has 128 tokens but the context window is 128"):
        eng.add_request("c", [1] * 128, SamplingParams())
    with pytest.raises(RequestError, match="needs 9 KV blocks but the pool holds 8"):
        LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=8)).add_request("d", [1] * 130, SamplingParams())
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    assert not eng.has_unfinished()
    eng.check_integrity()


def test_continue_from_first_token_and_pulled_blocks(tiny_model_dir):
    """The decode-service path: KV of the full prompt blocks arrives from elsewhere, plus the first token."""
    loaded = load_model(tiny_model_dir)
    prompt = prompts_for(258, (45,), seed=6)[0]  # 2 full blocks + 13-token tail
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=5)
    src = LLMEngine(loaded, EngineConfig(num_blocks=16))
    [[full]] = src.generate([prompt], params)
    keys = _keys(src, prompt)
    src_ids = [src.pool.block_id_of(k) for k in keys]

    dst = LLMEngine(loaded, EngineConfig(num_blocks=16))
    filler = dst.pool.allocate(3)  # make the destination ids differ from the source ids
    got = dst.pool.allocate(2)
    for s_id, d_id, k in zip(src_ids, got, keys):
        dst.kv_pool[d_id].copy_(src.kv_pool[s_id])
        assert dst.pool.register_key(d_id, k)
    dst.add_request("c", prompt, params, first_token_ids=[full[0]], pinned_block_ids=got)
    assert [dst.pool.ref_count(b) for b in got] == [1, 1]
    rest: list[int] = []
    while dst.has_unfinished():
        for out in dst.step():
            rest.extend(out.new_token_ids)
    assert [full[0]] + rest == full
    assert dst.stats.computed_prefill_tokens == 13 + 1  # the tail and the first token, nothing pulled
    assert [dst.pool.ref_count(b) for b in got] == [0, 0]
    dst.pool.release(filler)
    dst.check_integrity()


def test_first_token_that_finishes_is_reported_without_compute(tiny_model_dir):
    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=8))
    eos = sorted(eng.eos_token_ids)[0]
    eng.add_request("e", [5, 6, 7], SamplingParams(max_tokens=4, n=2), first_token_ids=[eos, 9])
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert [(o.index, o.finished, o.finish_reason) for o in outs if o.index == 0] == [(0, True, "stop")]
    assert sum(len(o.new_token_ids) for o in outs if o.index == 1) == 3
    eng.check_integrity()


def test_a_sequence_outgrowing_the_pool_ends_alone(tiny_model_dir):
    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=4, max_model_len=512))
    eng.add_request("long", list(range(1, 11)), SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("short", list(range(1, 5)), SamplingParams(max_tokens=3, ignore_eos=True))
    got: dict[str, list] = {"long": [], "short": []}
    reasons = {}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        eng.check_integrity()
    assert reasons == {"long": "length", "short": "length"}
    assert len(got["short"]) == 3
    assert len(got["long"]) == 4 * 16 - 10 + 1  # KV fills every slot (the last token needs none), then it ends
    assert eng.pool.stats().num_in_use == 0


def test_a_prompt_waits_for_blocks_a_lease_holds_instead_of_ending(tiny_model_dir):
    """Issue 28: blocks held outside the scheduler (a prefill node's leases, a pull in progress) come back in
    bounded time: a prompt that fits the pool once they do waits (``stalled``: the worker then idles until
    a command arrives) rather than ending, and then gives the reference tokens."""
    loaded = load_model(tiny_model_dir)
    prompt = list(range(1, 41))
    [[want]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], SamplingParams(max_tokens=4))
    eng = LLMEngine(loaded, EngineConfig(num_blocks=8))
    leased = eng.pool.allocate(6)  # what leases for peers hold on a prefill node
    eng.add_request("r", prompt, SamplingParams(max_tokens=4))  # 3 blocks; 2 free: a first chunk, then it waits
    outs = [out for _ in range(6) for out in eng.step()]
    assert outs == [] and eng.stalled and eng.has_unfinished()
    assert eng.pool.num_free_blocks == 0
    eng.pool.release(leased)
    got = []
    while eng.has_unfinished():
        got.extend(t for out in eng.step() for t in out.new_token_ids)
    assert got == want and not eng.stalled
    eng.check_integrity()
    assert eng.pool.stats().num_in_use == 0


def test_pins_held_by_a_waiting_request_do_not_stall_a_chunked_prefill(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    a, b = list(range(1, 101)), list(range(1, 70))
    [[want_a], [want_b]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([a, b], SamplingParams(max_tokens=4))
    eng = LLMEngine(loaded, EngineConfig(num_blocks=8, max_num_batched_tokens=64))
    eng.add_request("A", a, SamplingParams(max_tokens=4))  # needs 7 of the 8 blocks
    pins = eng.pool.allocate(5)  # unkeyed stand-ins for KV pulled for B
    eng.add_request("B", b, SamplingParams(max_tokens=4), pinned_block_ids=pins)
    got: dict[str, list] = {"A": [], "B": []}
    for _ in range(200):
        for out in eng.step():
            got[out.request_id].extend(out.new_token_ids)
        eng.check_integrity()
        if not eng.has_unfinished():
            break
    assert got == {"A": want_a, "B": want_b}
    assert eng.pool.stats().num_in_use == 0


def test_block_keys_carried_with_the_request_are_the_ones_the_engine_keys_blocks_by(tiny_model_dir):
    """Keys computed once at the node's edge reach the pool unchanged: the engine does not hash the
    prompt again (keys made under another salt prove it), and keys that do not fit are refused."""
    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=32))
    prompt = prompts_for(258, (40,), seed=9)[0]
    assert eng.prompt_block_keys(prompt, b"") == _keys(eng, prompt)
    carried = eng.prompt_block_keys(prompt, b"other")
    assert carried != _keys(eng, prompt)
    with pytest.raises(ValueError, match="1 block keys for a prompt of 40 tokens \\(2 full blocks\\)"):
        eng.add_request("bad", prompt, SamplingParams(max_tokens=2), block_keys=carried[:1])
    eng.add_request("r", prompt, SamplingParams(max_tokens=2), block_keys=carried)
    while eng.has_unfinished():
        eng.step()
    assert [eng.pool.block_id_of(k) is not None for k in carried] == [True, True]
    assert [eng.pool.block_id_of(k) for k in _keys(eng, prompt)] == [None, None]
    eng.check_integrity()


def test_an_engine_takes_the_block_spec_it_is_given_and_refuses_another_models(tiny_model_dir):
    import dataclasses

    loaded = load_model(tiny_model_dir)
    spec = LLMEngine.block_spec_for(loaded, 32, kv_dtype="float32")
    eng = LLMEngine(loaded, EngineConfig(num_blocks=8), spec=spec)  # config's block size (16) is not used
    assert eng.spec is spec and eng.scheduler.spec is spec and eng.kv_pool.shape[4] == 32
    with pytest.raises(ValueError, match=r"the block spec \(3 layers"):
        LLMEngine(loaded, EngineConfig(num_blocks=8), spec=dataclasses.replace(spec, num_layers=3))


def _run_all(eng: LLMEngine) -> tuple[dict[int, list[int]], dict[int, str]]:
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.index] = out.finish_reason
    return tokens, reasons


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, ignore_eos=True, n=2, temperature=0),
    SamplingParams(max_tokens=40, ignore_eos=True, n=3, temperature=1.0, top_p=0.9, seed=1234,
                   presence_penalty=0.5, frequency_penalty=0.3),
], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_with_the_undisturbed_tokens(tiny_model_dir, params):
    """A request moved mid-stream (`resume_token_ids`) to a fresh engine: every sample continues with exactly
    the tokens of an undisturbed run (penalties count the resumed tokens as output; sampling is keyed by output
    position); a sample given as None is reported finished at once and never runs; a sample with no tokens
    yet starts from the prompt."""
    model = load_model(tiny_model_dir)
    prompt = list(range(3, 40))
    whole = LLMEngine(model, EngineConfig(num_blocks=64))
    whole.add_request("r", prompt, params)
    full, reasons = _run_all(whole)
    assert reasons == {i: "length" for i in range(params.n)} and all(len(full[i]) == 40 for i in range(params.n))
    cut = [17, 0, 5][: params.n]  # tokens each sample had sent when its node died
    resume: list[list[int] | None] = [full[i][:cut[i]] for i in range(params.n)]
    if params.n == 3:
        resume[2] = None  # this sample had finished already
    moved = LLMEngine(model, EngineConfig(num_blocks=64))
    moved.add_request("r", prompt, params, resume_token_ids=resume)
    rest, rest_reasons = _run_all(moved)
    for i in range(params.n):
        if resume[i] is None:
            assert rest[i] == [] and rest_reasons[i] == "resumed"
        else:
            assert resume[i] + rest[i] == full[i] and rest_reasons[i] == "length"
    assert moved.pool.stats().num_in_use == 0
    moved.check_integrity()


def test_resumed_tokens_are_checked(tiny_model_dir):
    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=8))
    with pytest.raises(RequestError, match="resumed tokens for 1 samples, n=2"):
        eng.add_request("a", [5, 6], SamplingParams(n=2), resume_token_ids=[[7]])
    with pytest.raises(RequestError, match="no unfinished sample"):
        eng.add_request("b", [5, 6], SamplingParams(n=2), resume_token_ids=[None, None])
    with pytest.raises(RequestError, match="either first tokens or resumed tokens"):
        eng.add_request("c", [5, 6], SamplingParams(), first_token_ids=[7], resume_token_ids=[[7]])
    assert not eng.has_unfinished()
