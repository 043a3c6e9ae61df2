"""Issue 13, test 2: the OpenAI API fuzzed from its fields (hypothesis): no answer is a 5xx, the server
stays up, and a fixed request gives the same tokens before and after the fuzz run."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.services.cluster import Cluster, get_json

EXAMPLES = 300
FIXED = {"model": "tiny", "prompt": "the fixed request", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "seed", "stop", "stop_token_ids", "stream", "stream_options", "ignore_eos", "logprobs", "echo",
          "user", "kvrelay", "response_format", "tools", "presence_penalty"]
# Mostly-valid bodies with a few fields replaced by anything, and bodies of anything at all.
base = st.fixed_dictionaries({"model": st.just("tiny"), "prompt": st.text(max_size=30),
                              "max_tokens": st.integers(1, 4)})
bodies = st.one_of(
    st.builds(lambda b, extra: {**b, **extra}, base, st.dictionaries(st.sampled_from(FIELDS), values, max_size=3)),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
    values,
)


def _post(url: str, path: str, body: Any) -> tuple[int, bytes]:
    data = json.dumps(body).encode()  # NaN and Infinity included: Python's JSON reader takes them
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_fuzzed_requests_never_get_a_5xx_and_change_nothing(tiny_model_dir):
    with Cluster(tiny_model_dir, overrides={"prefill": {"ports": []}}) as c:
        status, before = _post(c.url, "/v1/completions", FIXED)
        assert status == 200
        seen: dict[int, int] = {}

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=bodies, chat=st.booleans())
        def fuzz(body: Any, chat: bool) -> None:
            status, answer = _post(c.url, "/v1/chat/completions" if chat else "/v1/completions", body)
            seen[status] = seen.get(status, 0) + 1
            assert status < 500, (body, answer[:300])

        fuzz()
        print(f"\nfuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
        assert sum(seen.values()) >= EXAMPLES and get_json(c.url + "/health")["status"] == "ok"
        status, after = _post(c.url, "/v1/completions", FIXED)
        assert status == 200
        assert json.loads(after)["choices"][0]["text"] == json.loads(before)["choices"][0]["text"]


# Issue 65: the surfaces added since the test above was written, fuzzed on a disaggregated deployment.
schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "bogus"])},
                          optional={"maxLength": st.integers(-1, 5), "enum": st.lists(scalars, max_size=3),
                                    "pattern": st.sampled_from(["a+", "(", "[0-9]{1,3}"])}),
    lambda inner: st.fixed_dictionaries({"type": st.sampled_from(["object", "array"])}, optional={
        "properties": st.dictionaries(st.text(max_size=6), inner, max_size=3), "items": inner,
        "required": st.lists(st.text(max_size=6), max_size=2), "anyOf": st.lists(inner, max_size=2)}),
    max_leaves=6) | values
structured = st.dictionaries(
    st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "structural_tag"]),
    st.one_of(schemas, st.sampled_from(["a+", "[0-9]{1,3}", "(", 'root ::= "a"', "root ::= (", "x"]),
              st.lists(st.text(max_size=5), max_size=3), st.booleans()), max_size=2)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "bogus"])}, optional={
        "json_schema": st.fixed_dictionaries({"name": st.text(max_size=8)},
                                             optional={"schema": schemas, "strict": st.booleans()})}), values)
function = st.fixed_dictionaries({"name": st.text(max_size=8)},
                                 optional={"parameters": schemas, "description": st.text(max_size=10)})
tools = st.one_of(st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": function}),
                                     values), max_size=2), values)
tool_choice = st.one_of(st.sampled_from(["auto", "none", "required", "bogus"]),
                        st.fixed_dictionaries({"type": st.just("function"),
                                               "function": st.fixed_dictionaries({"name": st.text(max_size=8)})}),
                        values)
logit_bias = st.one_of(st.dictionaries(st.one_of(st.integers(-5, 300).map(str), st.text(max_size=4)),
                                       st.one_of(st.floats(-200, 200), values), max_size=3), values)
kvrelay = st.one_of(st.fixed_dictionaries({}, optional={"timings": st.one_of(st.booleans(), values),
                                                        "long_context": values}), values)
NEW_FIELDS = {"response_format": response_format, "structured_outputs": structured, "tools": tools,
              "tool_choice": tool_choice, "logit_bias": logit_bias, "kvrelay": kvrelay}
new_fields = st.fixed_dictionaries({}, optional=NEW_FIELDS)
generation = st.one_of(
    st.builds(lambda extra, text, k: {"model": "tiny", "prompt": text, "max_tokens": k, **extra},
              new_fields, st.text(max_size=20), st.integers(1, 4)).map(lambda b: ("/v1/completions", b)),
    st.builds(lambda extra, text, k: {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                      "max_tokens": k, **extra},
              new_fields, st.text(max_size=20), st.integers(1, 4)).map(lambda b: ("/v1/chat/completions", b)))
tokenize = st.one_of(
    st.fixed_dictionaries({"model": st.just("tiny")}, optional={"prompt": st.one_of(st.text(max_size=20), values),
                                                                "messages": values, "tools": tools}),
    values).map(lambda b: ("/tokenize", b))
detokenize = st.one_of(
    st.fixed_dictionaries({"model": st.just("tiny"),
                           "tokens": st.one_of(st.lists(st.integers(-3, 2**40), max_size=6), values)}),
    values).map(lambda b: ("/detokenize", b))


def _names_a_field(body: Any, error: dict[str, Any]) -> bool:
    """An error names what was wrong: its ``param``, or a field of the request (or the body itself) in its message."""
    message = error.get("message") or ""
    fields = list(body) if isinstance(body, dict) else []
    return bool(error.get("param")) or any(f and f in message for f in fields) or "body" in message


def test_fuzzed_new_fields_get_a_200_or_a_4xx_naming_the_field_and_leave_every_block_free(tiny_model_dir):
    from tests.services.test_aborts import settled

    with Cluster(tiny_model_dir, overrides={"router": {"enable_auto_tool_choice": True}}) as c:
        seen: dict[tuple[str, int], int] = {}
        unnamed: list[tuple[Any, dict]] = []

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(call=st.one_of(generation, generation, tokenize, detokenize))
        def fuzz(call: tuple[str, Any]) -> None:
            path, body = call
            status, answer = _post(c.url, path, body)
            seen[path, status] = seen.get((path, status), 0) + 1
            assert status == 200 or 400 <= status < 500, (path, body, answer[:300])
            if status != 200:
                error = json.loads(answer)["error"]
                assert error["code"] == status and error["message"], (path, body, error)
                if not _names_a_field(body, error):
                    unnamed.append((body, error))

        fuzz()
        print(f"\nfuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
        assert unnamed == []
        assert get_json(c.url + "/health")["status"] == "ok"
        assert not any(settled(c).values())
        status, _ = _post(c.url, "/v1/completions", FIXED)
        assert status == 200
