"""`StructuredOutput`: what it refuses (exact messages) and its round trip through `SamplingParams` on the wire."""

from __future__ import annotations

import pytest
from kvrelay.model.sampling_params import SamplingParams
from kvrelay.model.structured import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutput
from kvrelay.transfer.wire import (
    GenerationMessage,
    WireError,
    decode_generation,
    encode_generation,
    params_from_wire,
    params_to_wire,
)

SCHEMA = '{"properties":{"a":{"type":"integer"}},"required":["a"],"type":"object"}'


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("xml",), {}, "structured output kind must be one of json, json_object, regex, choice, grammar, got 'xml'"),
        (("regex",), {}, "a regex constraint needs a non-empty spec"),
        (("json",), {}, "a json constraint needs a non-empty spec"),
        (("grammar", ""), {}, "a grammar constraint needs a non-empty spec"),
        (("regex", "a" * (MAX_SPEC_CHARS + 1)), {}, "a regex spec must be a string of at most 65536 characters"),
        (("regex", 5), {}, "a regex spec must be a string of at most 65536 characters"),
        (("json", "{"), {}, "the JSON schema is not valid JSON: Expecting property name enclosed in double quotes: "
                            "line 1 column 2 (char 1)"),
        (("json", "[1]"), {}, "a JSON schema must be an object"),
        (("choice",), {}, "choice takes 1 to 256 strings, got 0"),
        (("choice",), {"choices": ("x",) * (MAX_CHOICES + 1)}, "choice takes 1 to 256 strings, got 257"),
        (("choice",), {"choices": ("yes", "")}, "every choice must be a non-empty string"),
        (("choice",), {"choices": ("yes", 3)}, "every choice must be a non-empty string"),
        (("choice",), {"choices": ("a" * 40000, "b" * 30000)}, "the choices are over 65536 characters in all"),
        (("regex", "a"), {"choices": ("a",)}, "choices belong to kind 'choice', not 'regex'"),
    ],
)
def test_invalid_constraints_are_refused_naming_the_problem(args, kwargs, message):
    with pytest.raises(ValueError) as err:
        StructuredOutput(*args, **kwargs)
    assert str(err.value) == message


def test_valid_constraints_and_their_cache_key():
    choice = StructuredOutput("choice", choices=("yes", "no", "😀"))
    assert choice.cache_key == ("choice", "", ("yes", "no", "😀"))
    # strict changes nothing compiled (every schema compiles strictly): one grammar for both
    assert StructuredOutput("json", SCHEMA, strict=True).cache_key == ("json", SCHEMA, ())
    assert StructuredOutput("json", SCHEMA).cache_key == ("json", SCHEMA, ())
    assert StructuredOutput("json_object").cache_key == ("json_object", "", ())
    assert StructuredOutput("regex", "a" * MAX_SPEC_CHARS).spec == "a" * MAX_SPEC_CHARS  # the limit itself is fine


@pytest.mark.parametrize(
    "out",
    [
        StructuredOutput("json", SCHEMA, strict=True),
        StructuredOutput("json_object"),
        StructuredOutput("regex", r"\d{3}-\d{4}"),
        StructuredOutput("choice", choices=("café", "😀", 'a"b', "new\nline")),
        StructuredOutput("grammar", 'root ::= "a" | "b"'),
    ],
)
def test_every_kind_round_trips_through_the_wire(out):
    assert StructuredOutput.from_wire(out.to_wire()) == out
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, n=2, structured_outputs=out)
    assert params_from_wire(params_to_wire(params)) == params
    msg = GenerationMessage("r1", [5, 6, 7], params, b"", first_token_ids=[9, 10])
    assert decode_generation(encode_generation(msg)) == msg


def test_unconstrained_params_round_trip_with_none():
    assert params_to_wire(SamplingParams())["structured_outputs"] is None
    assert params_from_wire(params_to_wire(SamplingParams())).structured_outputs is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("json", "params.structured_outputs: structured output: expected a map of kind, spec, choices, strict"),
        ({"kind": "regex", "spec": "a", "extra": 1},
         "params.structured_outputs: structured output: expected a map of kind, spec, choices, strict"),
        ({"kind": "regex", "spec": 5}, "params.structured_outputs: structured output: a field has the wrong type"),
        ({"kind": 1}, "params.structured_outputs: structured output: a field has the wrong type"),
        ({"kind": "choice", "choices": ["a", 2]},
         "params.structured_outputs: structured output: a field has the wrong type"),
        ({"kind": "json", "spec": SCHEMA, "strict": 1},
         "params.structured_outputs: structured output: a field has the wrong type"),
        ({"kind": "regex"}, "params.structured_outputs: a regex constraint needs a non-empty spec"),
        ({"kind": "xml", "spec": "a"}, "params.structured_outputs: structured output kind must be one of json, "
                                       "json_object, regex, choice, grammar, got 'xml'"),
    ],
)
def test_malformed_constraints_on_the_wire_are_wire_errors(value, message):
    wire = params_to_wire(SamplingParams())
    wire["structured_outputs"] = value
    with pytest.raises(WireError) as err:
        params_from_wire(wire)
    assert str(err.value) == message


def test_sampling_params_refuse_anything_but_a_constraint():
    with pytest.raises(ValueError, match="^structured_outputs must be a .*got str$"):
        SamplingParams(structured_outputs="regex")  # type: ignore[arg-type]
