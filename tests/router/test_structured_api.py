"""The request fields that constrain an output (`router.structured_api`), read by the router without a network:
every spelling, one constraint per request, and 400s that name the field."""

from __future__ import annotations

import json

import pytest
from kvrelay.model.structured import StructuredOutput
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.router.backends import NodeRefused
from kvrelay.router.dispatch import _param_of
from kvrelay.router.openai_api import ApiError, ServedModel, parse_chat, parse_completion, parse_completions
from kvrelay.router.structured_api import StructuredError, check_compiles, structured_from_body

SCHEMA = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "integer"}}, "required": ["a"]}
# compact, keys in the client's order (properties are generated in it)
COMPACT = '{"type":"object","properties":{"b":{"type":"boolean"},"a":{"type":"integer"}},"required":["a"]}'


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> ServedModel:
    return ServedModel("tiny", 258, 128, 4, load_tokenizer(tiny_model_dir))


@pytest.mark.parametrize(
    ("body", "want", "param"),
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object"), "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         StructuredOutput("json", COMPACT, strict=True), "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
         StructuredOutput("json", COMPACT), "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": None}}},
         StructuredOutput("json", COMPACT), "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", COMPACT), "structured_outputs.json"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json", COMPACT),
         "structured_outputs.json"),
        ({"structured_outputs": {"regex": r"\d+"}}, StructuredOutput("regex", r"\d+"), "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput("choice", choices=("yes", "no")),
         "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"'),
         "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object"),
         "structured_outputs.json_object"),
        # vLLM's knobs that change nothing here are accepted beside the constraint
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True, "backend": "xgrammar",
                                 "json_object": False}}, StructuredOutput("regex", "a"), "structured_outputs.regex"),
        ({"guided_json": SCHEMA}, StructuredOutput("json", COMPACT), "guided_json"),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json", COMPACT), "guided_json"),
        ({"guided_regex": "[ab]+"}, StructuredOutput("regex", "[ab]+"), "guided_regex"),
        ({"guided_choice": ["x", "y"]}, StructuredOutput("choice", choices=("x", "y")), "guided_choice"),
        ({"guided_grammar": 'root ::= "b"'}, StructuredOutput("grammar", 'root ::= "b"'), "guided_grammar"),
        # text is no constraint: it does not conflict with one
        ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutput("regex", "a"), "guided_regex"),
        ({"guided_regex": None, "structured_outputs": None, "guided_choice": ["z"]},
         StructuredOutput("choice", choices=("z",)), "guided_choice"),
    ],
)
def test_every_field_reads_into_one_constraint(body, want, param):
    assert structured_from_body(body) == (want, param)


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
         "one constraint per request: got response_format, guided_regex", "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
         "one constraint per request: got structured_outputs, guided_choice", "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
          "structured_outputs": {"json_object": True}},
         "one constraint per request: got response_format, structured_outputs", "structured_outputs"),
        ({"guided_json": SCHEMA, "guided_regex": "a", "guided_grammar": 'root ::= "a"'},
         "one constraint per request: got guided_json, guided_regex, guided_grammar", "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs takes exactly one of json, regex, choice, grammar, json_object, got 2",
         "structured_outputs"),
        ({"structured_outputs": {}},
         "structured_outputs takes exactly one of json, regex, choice, grammar, json_object, got 0",
         "structured_outputs"),
        ({"structured_outputs": {"regexp": "a"}},
         "structured_outputs: unknown field 'regexp'; it takes one of json, regex, choice, grammar, json_object",
         "structured_outputs.regexp"),
        ({"structured_outputs": "a"}, "structured_outputs must be an object", "structured_outputs"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object must be true",
         "structured_outputs.json_object"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice: choice takes 1 to 256 strings, got 0",
         "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar: a grammar constraint needs a "
                                                  "non-empty spec", "structured_outputs.grammar"),
        ({"response_format": "json"}, "response_format must be an object with a string type", "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema, "
                                               "got 'xml'", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object with a schema",
         "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
         "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"),
        ({"guided_json": "{"}, "guided_json is not valid JSON: Expecting property name enclosed in double quotes: "
                               "line 1 column 2 (char 1)", "guided_json"),
        ({"guided_json": [1]}, "guided_json must be a JSON schema object", "guided_json"),
        ({"guided_regex": 5}, "guided_regex must be a string", "guided_regex"),
        ({"guided_regex": "a" * 65537}, "guided_regex is over 65536 characters", "guided_regex"),
        ({"guided_choice": "yes"}, "guided_choice must be a list of strings", "guided_choice"),
        ({"guided_choice": ["yes", ""]}, "guided_choice: every choice must be a non-empty string", "guided_choice"),
        ({"guided_grammar": {"root": "a"}}, "guided_grammar must be a string", "guided_grammar"),
        ({"guided_json_object": True}, 'guided_json_object is not a field; use response_format: '
                                       '{"type": "json_object"}', "guided_json_object"),
    ],
)
def test_malformed_or_conflicting_fields_name_the_field(body, message, param):
    with pytest.raises(StructuredError) as err:
        structured_from_body(body)
    assert (str(err.value), err.value.param) == (message, param)


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema is not a valid JSON schema: 'nonsense' is not valid under any of the "
         "given schemas (at type)", "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": {"type": "string", "maxLength": -1}}},
         "structured_outputs.json is not a valid JSON schema: -1 is less than the minimum of 0 (at maxLength)",
         "structured_outputs.json"),
        ({"guided_json": {"type": "object", "properties": {"a": {"minimum": "3"}}}},
         "guided_json is not a valid JSON schema: '3' is not of type 'number' (at properties/a/minimum)",
         "guided_json"),
        ({"guided_regex": "("}, "guided_regex is not a valid regular expression: missing ), unterminated subpattern "
                                "at position 0", "guided_regex"),
        ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex is not a valid regular expression: "
                                                     "bad character range z-a at position 1",
         "structured_outputs.regex"),
    ],
)
def test_malformed_schemas_and_regexes_are_400s_naming_the_field(served, body, message, param):
    out, where = structured_from_body(body)
    with pytest.raises(StructuredError) as err:
        check_compiles(out, where)
    assert (str(err.value), err.value.param) == (message, param)
    for parse, base in ((parse_completion, {"prompt": "x"}), (parse_chat, {"messages": [{"role": "user",
                                                                                          "content": "x"}]})):
        with pytest.raises(ApiError) as api:
            parse({"model": "tiny", **base, **body}, served)
        assert (api.value.status, api.value.message, api.value.param) == (400, message, param)


def test_a_grammar_the_router_cannot_check_passes_to_the_nodes(served):
    """EBNF is compiled by the nodes only; the router keeps the field so a node's refusal names it."""
    req = parse_completion({"model": "tiny", "prompt": "x", "structured_outputs": {"grammar": "root ::= nope"}},
                           served)
    assert req.params.structured_outputs == StructuredOutput("grammar", "root ::= nope")
    assert req.structured_param == "structured_outputs.grammar"
    refused = NodeRefused(400, "structured output: the grammar constraint does not compile: Rule \"nope\" ...")
    assert _param_of(req, refused) == "structured_outputs.grammar"
    assert _param_of(req, NodeRefused(400, "prompt is too long")) is None


def test_parsed_requests_carry_the_constraint_and_its_field(served):
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 4,
                       "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}}},
                      served)
    assert chat.params.structured_outputs == StructuredOutput("json", COMPACT, strict=True)
    assert (chat.params.n, chat.structured_param) == (2, "response_format.json_schema.schema")
    reqs = parse_completions({"model": "tiny", "prompt": ["a", "b"], "guided_choice": ["yes", "no"]}, served)
    assert [(r.params.structured_outputs, r.structured_param) for r in reqs] == [
        (StructuredOutput("choice", choices=("yes", "no")), "guided_choice")] * 2
    plain = parse_completion({"model": "tiny", "prompt": "a", "response_format": {"type": "text"}}, served)
    assert (plain.params.structured_outputs, plain.structured_param) == (None, None)


def test_a_model_without_a_tokenizer_refuses_constraints():
    bare = ServedModel("tiny", 258, 128, 4, None)
    assert parse_completion({"model": "tiny", "prompt": [5, 6]}, bare).params.structured_outputs is None
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "tiny", "prompt": [5, 6], "guided_regex": "a"}, bare)
    assert (err.value.status, err.value.message, err.value.param) == (
        400, "structured outputs need the model's tokenizer; this model has none", "guided_regex")
