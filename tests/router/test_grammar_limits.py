"""An EBNF grammar over the router's bounds (`router.grammar_limits`) is a 400 naming the field and the limit,
answered while the request is parsed: before it is queued, so no node ever compiles it (gap B of the
2026-12-07 edges notes: the 500-, 5,000- and 30,000-deep grammars of its recipe reached every node)."""

from __future__ import annotations

import pytest
from kvrelay.model.structured import StructuredOutput
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.router.grammar_limits import GrammarLimits, GrammarShape, shape_of
from kvrelay.router.openai_api import ApiError, ServedModel, parse_chat, parse_completion


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> ServedModel:
    return ServedModel("tiny", 258, 128, 4, load_tokenizer(tiny_model_dir))


def nested(k: int) -> str:
    return "root ::= " + "(" * k + '"a"' + ")" * k


def rules(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "end"\n'


def test_the_shape_counts_outside_literals_classes_and_comments():
    grammar = ('root ::= ("a" | b)* # ((( | ::=\n'
               'b ::= "(\\"|::=" [(|\\]] ((c) | "x")\n'
               'c ::= [a-z]+')
    assert shape_of(grammar) == GrammarShape(nesting=2, rules=3, alternatives=2)
    assert shape_of(nested(500)) == GrammarShape(500, 1, 0)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"structured_outputs": {"grammar": nested(500)}}, "structured_outputs.grammar",
     "structured_outputs.grammar has 500 levels of parentheses, over the limit of 64 (router.max_grammar_nesting)"),
    ({"structured_outputs": {"grammar": nested(5000)}}, "structured_outputs.grammar",
     "structured_outputs.grammar has 5000 levels of parentheses, over the limit of 64 (router.max_grammar_nesting)"),
    ({"guided_grammar": nested(30000)}, "guided_grammar",
     "guided_grammar is 60012 bytes, over the limit of 32768 (router.max_grammar_bytes)"),
    ({"guided_grammar": rules(500)}, "guided_grammar",
     "guided_grammar has 502 rules, over the limit of 500 (router.max_grammar_rules)"),
    ({"structured_outputs": {"grammar": "root ::= " + " | ".join(['"w"'] * 2002)}}, "structured_outputs.grammar",
     "structured_outputs.grammar has 2001 alternatives (|), over the limit of 2000 (router.max_grammar_alternatives)"),
])
def test_a_grammar_over_a_limit_is_a_400_naming_the_field_and_the_limit(served, body, param, message):
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 4, **body}, served)
    assert (err.value.status, err.value.param, str(err.value)) == (400, param, message)
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body}, served)
    assert (err.value.status, err.value.param, str(err.value)) == (400, param, message)


def test_grammars_within_the_limits_pass_and_the_limits_are_the_config_s(served):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    for grammar in (nested(64), rules(498), "root ::= " + " | ".join(['"w"'] * 2001)):
        req = parse_completion({**body, "guided_grammar": grammar}, served)
        assert req.params.structured_outputs == StructuredOutput("grammar", grammar)
    tight = ServedModel("tiny", 258, 128, 4, served.tokenizer, grammar_limits=GrammarLimits(max_nesting=3))
    with pytest.raises(ApiError) as err:
        parse_completion({**body, "guided_grammar": nested(4)}, tight)
    assert str(err.value) == "guided_grammar has 4 levels of parentheses, over the limit of 3 " \
                             "(router.max_grammar_nesting)"
