"""Tool calling with SmolLM2-135M-Instruct served by `kvrelay up` (one decode node), through the official client
(issue 32): calls forced by tool_choice are valid against the tool's schema, a tool result gets an answer, streamed
call deltas reassemble to exactly the call not streamed, and a choice naming no tool is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.real_model import RealModel
from tests.services.cluster import Cluster

MODEL = "smollm2-135m-instruct"
# Bounded strings and numbers (the schema's limits are forced too): a 135M model left free repeats digits for ever.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris", "minLength": 1, "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 32},
                                                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query", "max_results"]}}}
NAME_TO_SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "You call functions to answer."}, {"role": "user", "content": text}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_call(call, names: tuple[str, ...]) -> dict:
    """A returned call is well formed and its arguments validate against its tool's parameters."""
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, NAME_TO_SCHEMA[call.function.name])
    return args


def streamed(client: openai.OpenAI, **kwargs) -> tuple[list[dict], str, str | None]:
    """Calls reassembled from ``delta.tool_calls`` (the first delta of each carries id, type and name), the
    content, and the finish reason."""
    calls: list[dict] = []
    content, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reason = choice.finish_reason or reason
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            else:
                assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, content, reason


@pytest.fixture(scope="module")
def client(smollm2: RealModel):
    overrides = {"model": {"name": MODEL, "dtype": "float32"}, "prefill": {"ports": []},
                 "router": {"enable_auto_tool_choice": True}}
    with Cluster(smollm2.model_dir, overrides=overrides) as c:
        yield openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_round_trip_named_call_then_tool_result_then_answer(client: openai.OpenAI) -> None:
    messages = ask("What is the weather in Paris, in celsius?")
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, SEARCH],
                                         tool_choice=named("get_weather"), max_tokens=48, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's: a named call ends in stop
    [call] = choice.message.tool_calls
    args = check_call(call, ("get_weather",))
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"city": args["city"], "temperature": 21, "sky": "sunny"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, SEARCH], max_tokens=32,
                                           temperature=0)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content and answer.message.content.strip()


def test_required_calls_validate_against_their_tools(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ask("Find recent news about the Moon landing."),
                                         tools=[WEATHER, SEARCH], tool_choice="required", max_tokens=64,
                                         temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        check_call(call, ("get_weather", "search_web"))


@pytest.mark.parametrize("prompt", ["Weather in Tokyo?", "Tell me a joke about cats.", "Is it raining in Lima?"])
def test_named_tool_choice_always_gives_a_valid_call(client: openai.OpenAI, prompt: str) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ask(prompt), tools=[WEATHER, SEARCH],
                                         tool_choice=named("search_web"), max_tokens=64, temperature=0.7, seed=7,
                                         n=2)
    assert len(out.choices) == 2
    for choice in out.choices:  # each choice parsed on its own
        assert choice.finish_reason == "stop"
        [call] = choice.message.tool_calls
        check_call(call, ("search_web",))


@pytest.mark.parametrize("tool_choice", ["required", named("get_weather")])
def test_streamed_tool_calls_reassemble_to_the_whole_call(client: openai.OpenAI, tool_choice) -> None:
    request = {"model": MODEL, "messages": ask("What is the weather in Rome?"), "tools": [WEATHER, SEARCH],
               "tool_choice": tool_choice, "max_tokens": 64, "temperature": 0}
    whole = client.chat.completions.create(**request).choices[0]
    calls, content, reason = streamed(client, **request)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == "" and reason == whole.finish_reason
    assert all(c["id"].startswith("call_") for c in calls)


def test_auto_without_a_call_is_plain_content_streamed_or_not(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "tools": [WEATHER], "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.message.tool_calls is None and "Paris" in whole.message.content
    calls, content, reason = streamed(client, **request)
    assert calls == [] and content == whole.message.content and reason == whole.finish_reason == "stop"


def test_a_choice_naming_no_tool_is_a_400_naming_tool_choice(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), tools=[WEATHER],
                                       tool_choice=named("get_time"), max_tokens=8)
    assert err.value.status_code == 400 and err.value.param == "tool_choice"
    assert "tool_choice names function 'get_time', which is not in tools (they are get_weather)" in err.value.message


def test_logprobs_tokens_as_token_ids(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(c.token.startswith("token_id:") for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    assert all(c.top_logprobs[0].token == c.token for c in content)  # greedy: the top one
