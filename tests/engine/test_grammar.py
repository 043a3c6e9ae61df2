"""Constrained decoding (`engine.grammar`): compiling and caching constraints, a matcher rebuilt from tokens equal to
one that accepted them one by one, the engine masking each sample to its grammar (stop, length, preemption, n > 1,
a first token sampled elsewhere), and on the real model outputs that match the constraint."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jsonschema
import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
from kvrelay.engine.grammar import GrammarError, Grammars, Matcher, apply_masks, lift_min_tokens
from kvrelay.model.loader import load_model
from kvrelay.model.sampling_params import SamplingParams
from kvrelay.model.structured import StructuredOutput
from kvrelay.model.tokenizer import load_tokenizer

TINY_VOCAB, TINY_EOS = 258, 257  # the tiny model's tokenizer: one token per byte (ids 0-255), <s>, </s>
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"type": "boolean"}}, "required": ["a", "b"]}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
PHONE = StructuredOutput("regex", r"\d{3}-\d{4}")


def ids(text: str) -> list[int]:
    return list(text.encode())  # the tiny tokenizer's ids


def allowed(*matchers: Matcher | None) -> list[list[int]]:
    """Per matcher, the token ids it allows next (all of them for None)."""
    logits = torch.zeros(len(matchers), TINY_VOCAB)
    apply_masks(logits, list(matchers))
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


@pytest.fixture(scope="module")
def grammars(tiny_model_dir) -> Grammars:
    text = '{"a": 42, "b": true} café 😀'
    assert load_tokenizer(tiny_model_dir).encode(text, add_special_tokens=False) == ids(text)
    return Grammars(tiny_model_dir, TINY_VOCAB, [TINY_EOS])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir)


def run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
        **add: object) -> list[list[tuple[list[int], str | None]]]:
    """Every prompt to completion: ``[prompt][sample] -> (output token ids, finish reason)``; the pool checked
    after each step and empty at the end."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    out = {f"q{i}": [([], None) for _ in range(p.n)] for i, p in enumerate(plist)}
    for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
        eng.add_request(f"q{i}", prompt, p, **add)  # type: ignore[arg-type]
    while eng.has_unfinished():
        for o in eng.step():
            toks, _ = out[o.request_id][o.index]
            out[o.request_id][o.index] = (toks + o.new_token_ids, o.finish_reason if o.finished else None)
        eng.check_integrity()
    assert eng.pool.stats().num_in_use == 0
    return [out[f"q{i}"] for i in range(len(prompts))]


# ------------------------------------------------------------------ Grammars and Matcher (tiny tokenizer)
def test_second_compile_is_a_cache_hit_and_failures_name_the_reason(tiny_model_dir):
    g = Grammars(tiny_model_dir, TINY_VOCAB, [TINY_EOS])
    first = g.compile(JSON)
    assert g.compiles == 1
    assert g.compile(StructuredOutput("json", json.dumps(SCHEMA))) is first and g.compiles == 1
    assert g.compile(StructuredOutput("json", json.dumps(SCHEMA), strict=True)) is first  # strict: the same grammar
    g.compile(PHONE)
    g.matcher(PHONE, ids("555"))
    assert g.compiles == 2
    carried = StructuredOutput("regex", r"\d+", compiled=g.compile(PHONE))  # a node's compile, carried in-process
    g.matcher(carried, ids("555"))
    assert g.compiles == 2
    for out, reason in [
        (StructuredOutput("grammar", "root ::= nope"), 'EBNF parser error at line 1, column 10: Rule "nope" is not '
                                                       "defined"),
        (StructuredOutput("regex", "(?=a)a"), "Regex parsing error at position 3: Lookahead is not supported yet."),
        (StructuredOutput("json", '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
    ]:
        with pytest.raises(GrammarError) as err:
            g.compile(out)
        assert str(err.value) == f"structured output: the {out.kind} constraint does not compile: {reason}"
    assert g.compiles == 2  # failures are not cached
    with pytest.raises(GrammarError) as err:
        Grammars(None, TINY_VOCAB, [TINY_EOS]).compile(PHONE)
    assert str(err.value) == ("structured output: the model has no tokenizer.json (the vocabulary a constraint is "
                              "compiled for)")


def test_a_replayed_matcher_equals_one_that_accepted_token_by_token(grammars):
    text = ids('{"a": 42, "b": true}')
    compiled = grammars.compile(JSON)
    stepped = Matcher(compiled)
    for cut in range(len(text) + 1):
        replayed = Matcher(compiled, text[:cut])
        assert allowed(replayed) == allowed(stepped), f"after {cut} tokens"
        assert not replayed.terminated and not stepped.terminated
        if cut < len(text):
            assert stepped.accept(text[cut])
    assert allowed(stepped) == [[TINY_EOS]]  # the object is whole: only the stop token is left
    assert stepped.accept(TINY_EOS) and stepped.terminated
    assert Matcher(compiled, [*text, TINY_EOS]).terminated
    assert allowed(Matcher(compiled, ids('{"a": '))) == [ids("0123456789")]
    assert allowed(Matcher(compiled, ids('{"a": 4'))) == [ids(",0123456789")]
    assert allowed(Matcher(compiled, ids('{"a": 42'))) == [ids(",")]  # at most 99


def test_a_token_outside_the_grammar_is_refused_with_its_position(grammars):
    with pytest.raises(GrammarError) as err:
        grammars.matcher(JSON, ids('{"a": x'))
    assert str(err.value) == "structured output: output token 120 at position 6 does not match the constraint"
    with pytest.raises(GrammarError, match="^structured output: output token 257 at position 2 does not match"):
        grammars.matcher(PHONE, [*ids("12"), TINY_EOS])
    m = grammars.matcher(PHONE, ids("12"))
    before = allowed(m)
    assert not m.accept(ord("-")) and allowed(m) == before  # refused: the state is unchanged
    assert m.accept(ord("3")) and allowed(m) == [[ord("-")]]


def test_forks_are_independent(grammars):
    parent = grammars.matcher(PHONE, ids("555-"))
    child = parent.fork()
    for tok in ids("1234"):
        assert child.accept(tok)
    assert child.accept(TINY_EOS) and child.terminated
    assert not parent.terminated and allowed(parent) == [ids("0123456789")]
    assert allowed(parent) == allowed(grammars.matcher(PHONE, ids("555-")))
    other = parent.fork()
    assert other.accept(ord("9")) and not parent.terminated
    assert allowed(parent, other, None) == [ids("0123456789"), ids("0123456789"), list(range(TINY_VOCAB))]


def test_masks_leave_unconstrained_rows_alone(grammars):
    choice = grammars.matcher(StructuredOutput("choice", choices=("yes", "no", "nah")), [])
    logits = torch.randn(3, TINY_VOCAB)
    plain = logits[1].clone()
    apply_masks(logits, [choice, None, grammars.matcher(StructuredOutput("choice", choices=("nah",)), ids("na"))])
    assert torch.equal(logits[1], plain)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ord("n"), ord("y")]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [ord("h")]


def test_choices_with_any_characters_can_be_generated(grammars):
    """Non-ASCII choices (an emoji is beyond the BMP: two surrogates when ASCII-escaped) and escapes."""
    choices = ("café", "😀", "日本語", 'say "hi"', "back\\slash", "new\nline", "tab\tx")
    out = StructuredOutput("choice", choices=choices)
    for c in choices:
        assert grammars.matcher(out, [*ids(c), TINY_EOS]).terminated, c
    with pytest.raises(GrammarError, match="output token 257 at position 3"):
        grammars.matcher(out, [*ids("caf"), TINY_EOS])  # a prefix of a choice is no choice


def test_min_tokens_gives_way_to_a_grammar_that_has_ended():
    params = SamplingParams(min_tokens=3, stop_token_ids=(7,))
    ended = torch.full((TINY_VOCAB,), float("-inf"))
    ended[[TINY_EOS, 7]] = 0.0
    assert lift_min_tokens(params, ended, 1, {TINY_EOS}) == SamplingParams(stop_token_ids=(7,))
    assert lift_min_tokens(params, ended, 3, {TINY_EOS}) is params  # min_tokens is met: nothing held back
    open_ = ended.clone()
    open_[ord("a")] = 0.0
    assert lift_min_tokens(params, open_, 1, {TINY_EOS}) is params  # the grammar may go on: min_tokens holds


# ------------------------------------------------------------------ the engine (tiny model: exact tokens)
def text_of(tokens: list[int]) -> str:
    """The bytes of an output, its final stop token left out."""
    assert tokens[-1] == TINY_EOS
    return bytes(tokens[:-1]).decode()


def test_each_sample_matches_its_constraint_and_stops_when_it_ends(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_blocks=64))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    grammar = StructuredOutput("grammar", 'root ::= "(" [a-c]{2,4} ")"')
    params = [SamplingParams(max_tokens=40, structured_outputs=PHONE),
              SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured_outputs=JSON),
              SamplingParams(max_tokens=10, structured_outputs=StructuredOutput("choice", choices=("yes", "no"))),
              SamplingParams(max_tokens=10, temperature=0.8, seed=2, structured_outputs=grammar),
              SamplingParams(max_tokens=60, structured_outputs=StructuredOutput("json_object"))]
    outs = run(eng, prompts, params)
    assert [reason for [(_, reason)] in outs] == ["stop"] * 5
    phone, obj, choice, ebnf, anything = (text_of(toks) for [(toks, _)] in outs)
    assert re.fullmatch(r"\d{3}-\d{4}", phone), phone
    jsonschema.validate(json.loads(obj), SCHEMA)
    assert choice in ("yes", "no")
    assert re.fullmatch(r"\([a-c]{2,4}\)", ebnf), ebnf
    assert isinstance(json.loads(anything), dict), anything
    assert eng.grammars.compiles == 5


def test_the_grammar_ends_a_sample_that_ignores_eos(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_blocks=32))
    [[(toks, reason)]] = run(eng, [[5, 6, 7]], SamplingParams(max_tokens=30, ignore_eos=True, structured_outputs=PHONE))
    assert (len(toks), reason) == (9, "stop") and re.fullmatch(r"\d{3}-\d{4}", text_of(toks))


def test_stop_tokens_and_max_tokens_cut_a_constrained_sample(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_blocks=32))
    [[(phone, _)], [(obj, _)]] = run(eng, [[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=30, structured_outputs=PHONE),
                                                              SamplingParams(max_tokens=60, structured_outputs=JSON)])
    [[cut_at_stop], [cut_at_length]] = run(eng, [[5, 6, 7], [8, 9]], [
        SamplingParams(max_tokens=30, stop_token_ids=(ord("-"),), structured_outputs=PHONE),
        SamplingParams(max_tokens=4, structured_outputs=JSON)])
    assert cut_at_stop == (phone[:4], "stop")  # a stop token the grammar allows ends it mid-grammar
    assert cut_at_length == (obj[:4], "length")  # mid-JSON: not valid JSON, and nothing else goes wrong


def test_min_tokens_past_the_grammar_s_end_stops_with_the_grammar(tiny):
    """The grammar allows only the stop token that min_tokens holds back: a sampled row of -inf could not be drawn
    from (torch raised in the engine step) and greedy picked token 0; the grammar wins. Before its end the grammar
    holds the stop token back itself, so the tokens are those of the request without min_tokens."""
    eng = LLMEngine(tiny, EngineConfig(num_blocks=32))
    for params in (SamplingParams(max_tokens=30, structured_outputs=PHONE),
                   SamplingParams(max_tokens=30, temperature=1.0, seed=3, structured_outputs=PHONE)):
        [[want]] = run(eng, [[5, 6, 7]], params)
        [[got]] = run(eng, [[5, 6, 7]], dataclasses.replace(params, min_tokens=12))
        assert got == want and want[1] == "stop" and len(want[0]) == 9


def test_preemption_and_recompute_keep_each_sample_s_grammar(tiny):
    prompts = [[3 + (7 * i + j) % 250 for j in range(30)] for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=11,
                            structured_outputs=StructuredOutput("regex", "[a-z]{35}"))
    ref = [run(LLMEngine(tiny, EngineConfig(num_blocks=64)), [p], params)[0] for p in prompts]
    eng = LLMEngine(tiny, EngineConfig(num_blocks=12))  # 4 × 5 blocks needed at the end: must preempt
    outs = run(eng, prompts, params)
    assert eng.stats.preemptions > 0
    assert outs == ref
    for [(toks, reason)] in outs:
        assert reason == "stop" and re.fullmatch("[a-z]{35}", text_of(toks))


def test_n_samples_fork_their_matchers(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_blocks=32))
    [samples] = run(eng, [[5, 6, 7]], SamplingParams(max_tokens=60, temperature=1.0, seed=9, n=3,
                                                     structured_outputs=JSON))
    assert len({tuple(t) for t, _ in samples}) == 3
    for toks, reason in samples:
        assert reason == "stop"
        jsonschema.validate(json.loads(text_of(toks)), SCHEMA)
    [[alone]] = run(eng, [[5, 6, 7]], SamplingParams(max_tokens=60, temperature=1.0, seed=9, structured_outputs=JSON))
    assert samples[0] == alone  # sample 0 of n is the n = 1 stream


def test_a_sample_continued_from_tokens_sampled_elsewhere_replays_them(tiny):
    """The decode node's side of the handoff: the first token (or every token so far, for a request that moved)
    is replayed into a fresh matcher, and the sample continues exactly as it would have."""
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=21, n=2, structured_outputs=JSON)
    [whole] = run(LLMEngine(tiny, EngineConfig(num_blocks=32)), [[5, 6, 7]], params)
    eng = LLMEngine(tiny, EngineConfig(num_blocks=32))
    [after_first] = run(eng, [[5, 6, 7]], params, first_token_ids=[toks[0] for toks, _ in whole])
    assert after_first == [(toks[1:], reason) for toks, reason in whole]
    [moved] = run(eng, [[5, 6, 7]], params, resume_token_ids=[whole[0][0][:6], whole[1][0][:3]])
    assert moved == [(whole[0][0][6:], "stop"), (whole[1][0][3:], "stop")]
    with pytest.raises(RequestError, match="^structured output: output token 120 at position 0 does not match"):
        eng.add_request("bad", [5, 6, 7], params, first_token_ids=[ord("x"), ord("{")])
    assert not eng.is_active("bad") and eng.pool.stats().num_in_use == 0


def test_top_logprobs_list_only_tokens_the_grammar_allows(tiny):
    """A token the grammar masks is no alternative: its -inf is not listed (nor written as JSON, where it is no
    number)."""
    eng = LLMEngine(tiny, EngineConfig(num_blocks=32))
    params = SamplingParams(max_tokens=5, logprobs=3, structured_outputs=StructuredOutput("choice", choices=("yes",
                                                                                                          "no")))
    eng.add_request("r", [5, 6, 7], params)
    steps = []
    while eng.has_unfinished():
        steps += [(o.new_token_ids, o.logprobs) for o in eng.step()]
    assert [[t for t, _ in lps[0].top] for _, lps in steps] == [sorted(ids("ny"), key=lambda t: t != steps[0][0][0]),
                                                                 [steps[1][0][0]], [TINY_EOS]]
    assert all(math.isfinite(v) for _, lps in steps for _, v in lps[0].top)
    assert [lps[0].logprob for _, lps in steps][1:] == [0.0, 0.0]  # the only token allowed


# ------------------------------------------------------------------ the real model (SmolLM2-135M-Instruct, greedy)
@pytest.fixture(scope="module")
def llm(smollm2):
    from kvrelay import LLM

    llm = LLM(smollm2.model_dir, dtype="float32", kv_cache_memory="256MiB")
    yield llm
    llm.close()


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_real_model_choice_regex_and_json_match_their_constraint(llm):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    questions = [ask("Is the sky blue? Answer yes or no."), ask("Write a phone number."),
                 ask("Describe a person as JSON with a name and an age.")]
    params = [SamplingParams(max_tokens=8, structured_outputs=StructuredOutput("choice", choices=("yes", "no"))),
              SamplingParams(max_tokens=16, structured_outputs=PHONE),
              SamplingParams(max_tokens=48, structured_outputs=StructuredOutput("json", json.dumps(person)))]
    choice, phone, obj = (out.outputs[0] for out in llm.chat(questions, params, use_tqdm=False))
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop", phone
    jsonschema.validate(json.loads(obj.text), person)
    assert obj.finish_reason == "stop"
    for out in (choice, phone, obj):
        assert out.token_ids[-1] in llm.engine.eos_token_ids  # the grammar ended with the model's stop token


def test_real_model_two_seeded_samples_both_match(llm):
    colors = {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "enum": ["red", "green", "blue", "yellow"]}}, "bright": {"type": "boolean"}}, "required": ["colors", "bright"]}
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=7, n=2,
                            structured_outputs=StructuredOutput("json", json.dumps(colors)))
    [first] = llm.chat(ask("Name some colors as JSON."), params, use_tqdm=False)
    for out in first.outputs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), colors)
