"""Tool calling without a network (issue 32): the parsers on exact strings, streams fed in every split against
the whole answer, tool_choice → schema, the 400s naming their field, the flags; and the logprobs fixes."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as hs
from kvrelay.deploy.cli import build_parser, serve_config
from kvrelay.deploy.config import load_config
from kvrelay.deploy.sizes import ConfigError
from kvrelay.model.sampling_params import TokenLogprobs
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.router.config import RouterConfig
from kvrelay.router.openai_api import ApiError, ServedModel, parse_chat, parse_completion, parse_tokenize
from kvrelay.router.openai_responses import logprobs_body
from kvrelay.router.text_output import SampleText
from kvrelay.router.tool_api import required_schema
from kvrelay.router.tool_calls import PARSER_NAMES, CallDelta, ParsedOutput, StreamDelta, ToolOutput, default_parser

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "local.yaml"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}
HERMES = ToolOutput("auto", "hermes")
LLAMA = ToolOutput("auto", "llama3_json")
MISTRAL = ToolOutput("auto", "mistral")
REQUIRED = ToolOutput("required")


def calls_of(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.calls]


# ------------------------------------------------------------------ parsers on exact strings
def test_hermes_content_then_several_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"arguments": {"zone": "UTC", "x": [1, {"y": "}]"}]}, "name": "get_time"}</tool_call>')
    out = HERMES.parse(text)
    assert out.content == "Let me check.\n"
    assert calls_of(out) == [("get_weather", '{"city": "Paris"}'),
                             ("get_time", '{"zone": "UTC", "x": [1, {"y": "}]"}]}')]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in out.calls)
    assert out.calls[0].to_openai() == {"id": out.calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert HERMES.finish_reason(out, "stop") == "tool_calls"


@pytest.mark.parametrize("text", [
    "no call at all",
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off: not a call
    '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',  # malformed JSON
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # a name that is not a string
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    '<tool_call>not json</tool_call>',
    "text <tool_call>",
])
def test_hermes_malformed_is_all_content(text):
    out = HERMES.parse(text)
    assert out == ParsedOutput(text, ())
    assert HERMES.finish_reason(out, "length") == "length"


def test_hermes_lenient_ends_and_no_arguments():
    assert calls_of(HERMES.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')) == [("f", '{"a": 1}')]
    assert calls_of(HERMES.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool')) == [("f", '{"a": 1}')]
    assert calls_of(HERMES.parse('<tool_call>{"name": "f"}</tool_call>')) == [("f", "{}")]
    assert calls_of(HERMES.parse('<tool_call>{"name": "f", "parameters": "s"}</tool_call> bye')) == [("f", '"s"')]


def test_llama3_json():
    out = LLAMA.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": null}')
    assert out.content is None and calls_of(out) == [("f", '{"x": 1}'), ("g", "null")]
    out = LLAMA.parse(' {"type": "function", "name": "f", "parameters": {}}\n{"name": "g", "parameters": {"y": 2}}')
    assert calls_of(out) == [("f", "{}"), ("g", '{"y": 2}')]
    for text in ['{"answer": 42}', 'Hello {"name": "f", "parameters": {}}', "  ", "<|python_tag|>print(1)",
                 '{"name": "f", "parameters": {"x": 1}']:
        assert LLAMA.parse(text) == ParsedOutput(text, ()), text


def test_mistral():
    out = MISTRAL.parse('Sure [TOOL_CALLS] [{"name": "f", "arguments": {"x": "y"}}, {"name": "g", "arguments": {}}]')
    assert out.content == "Sure " and calls_of(out) == [("f", '{"x": "y"}'), ("g", "{}")]
    for text in ["plain", '[TOOL_CALLS] [{"name": "f", "arguments": {}}', '[TOOL_CALLS] {"name": "f"}']:
        assert MISTRAL.parse(text) == ParsedOutput(text, ()), text


def test_required_and_named():
    out = REQUIRED.parse('[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]')
    assert out.content is None and calls_of(out) == [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")]
    assert REQUIRED.finish_reason(out, "stop") == "tool_calls" and REQUIRED.finish_reason(out, "length") == "length"
    cut = '[{"name":"get_weather","parameters":{"city":"Os'
    assert REQUIRED.parse(cut) == ParsedOutput(cut, ())
    named = ToolOutput("named", name="get_weather")
    out = named.parse('{"city":"Oslo"}')
    assert out.content is None and calls_of(out) == [("get_weather", '{"city":"Oslo"}')]
    assert named.finish_reason(out, "stop") == "stop"  # OpenAI's: a named function's call ends with stop


# ------------------------------------------------------------------ streams against the whole answer
STREAM_CASES = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris <"}}\n'
             '</tool_call>\n<tool_call>{"arguments": {"a": [1, {"b": "}"}]}, "name": "f"}</tool_call>'),
    (HERMES, "no calls, but < and <tool and <tool_cal at the end <tool_"),
    (HERMES, '<tool_call>{"name": "f", "arguments": 12.5}</tool_call>'),
    (HERMES, '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": {}}'),
    (LLAMA, '<|python_tag|>{"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", "parameters": {}}'),
    (LLAMA, '{"answer": {"name": 1}}'),
    (LLAMA, "<|python_ta"),
    (MISTRAL, 'ok [TOOL_CALLS][{"name": "f", "arguments": {"x": "[]{}"}}, {"name": "g", "arguments": {"y": 1}}]'),
    (REQUIRED, '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'),
    (ToolOutput("named", name="f"), '{"a":{"b":[1,2,"x"]}}'),
]


def replay(tool: ToolOutput, pieces: list[str]) -> tuple[str, list[dict], ParsedOutput]:
    """Stream ``pieces``; the content sent, each call reassembled from its deltas, and the stream's result."""
    stream = tool.stream()
    content, calls = "", []
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += delta.content
        for d in delta.calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls.append({"id": d.id, "name": d.name, "arguments": ""})
            calls[d.index]["arguments"] += d.arguments
    return content, calls, stream.result()


def check_stream(tool: ToolOutput, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    content, calls, result = replay(tool, pieces)
    whole = tool.parse(text)
    assert result.content == whole.content and calls_of(result) == calls_of(whole)
    assert [(c["name"], c["arguments"]) for c in calls] == calls_of(whole)
    assert [c["id"] for c in calls] == [c.id for c in result.calls]
    assert content == ((whole.content or "") if whole.calls else text)


@pytest.mark.parametrize(("tool", "text"), STREAM_CASES)
def test_stream_one_character_at_a_time_equals_the_whole_answer(tool, text):
    check_stream(tool, text, list(text))
    check_stream(tool, text, [text])


@pytest.mark.parametrize(("tool", "text"), STREAM_CASES)
def test_stream_random_splits_equal_the_whole_answer(tool, text):
    rng = random.Random(32)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        check_stream(tool, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(case=hs.sampled_from(STREAM_CASES), data=hs.data())
def test_stream_any_split_equals_the_whole_answer(case, data):
    tool, text = case
    cuts = sorted(data.draw(hs.sets(hs.integers(1, len(text) - 1), max_size=len(text))))
    check_stream(tool, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])


def test_stream_sends_content_before_markup_and_holds_back_only_a_possible_tag():
    stream = HERMES.stream()
    assert stream.feed("Hi <tool").content == "Hi "  # "<tool" may become <tool_call>
    assert stream.feed("box> more").content == "<toolbox> more"
    first = stream.feed('<tool_call>{"name": "f", "arguments": {"a"')
    assert first.content == "" and [c.to_openai() for c in first.calls] == [
        {"index": 0, "id": stream.calls[0].id, "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]
    assert [c.to_openai() for c in stream.feed(": 1}}").calls] == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert stream.feed("</tool_call>").calls == [] and stream.finish().calls == []
    assert stream.result().content == "Hi <toolbox> more"


def test_stream_delta_then_joins_a_call_s_pieces():
    a = StreamDelta("x", [CallDelta(0, "call_a", "f", '{"a"')])
    b = StreamDelta("y", [CallDelta(0, None, None, ": 1}"), CallDelta(1, "call_b", "g", "")])
    assert a.then(b) == StreamDelta("xy", [CallDelta(0, "call_a", "f", '{"a": 1}'), CallDelta(1, "call_b", "g", "")])
    assert a.calls[0].arguments == '{"a"'  # unchanged


# ------------------------------------------------------------------ requests
@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a Qwen-style chat template that renders tools, tool calls and tool results."""
    out = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:{{ c.function.arguments | tojson }}"
        "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def served(tool_model_dir) -> ServedModel:
    return ServedModel("tiny", 258, 4096, 4, load_tokenizer(tool_model_dir), tool_call_parser="hermes",
                       enable_auto_tool_choice=True)


def chat(served: ServedModel, **body):
    return parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}, served)


def test_tools_and_tool_messages_reach_the_template(served):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
    req = parse_chat({"model": "tiny", "messages": messages, "tools": [WEATHER], "tool_choice": "none"}, served)
    assert served.tokenizer.decode(req.prompt_token_ids) == (
        "<tools>" + json.dumps(WEATHER) + "\n</tools><user>weather?"  # trim_blocks: no newline after a tag
        '<assistant><tool_call>get_weather:{"city": "Paris"}</tool_call><tool>sunny[call_1]<assistant>')
    assert req.tool_output is None and req.params.structured_outputs is None  # none: plain content
    ids = parse_tokenize({"model": "tiny", "messages": messages, "tools": [WEATHER]}, served)
    assert ids == req.prompt_token_ids


def test_tool_choice_sets_the_output_and_the_constraint(served):
    auto = chat(served, tools=[WEATHER])  # auto: the default with tools
    assert auto.tool_output == ToolOutput("auto", "hermes") and auto.params.structured_outputs is None
    req = chat(served, tools=[WEATHER, TIME], tool_choice="required")
    assert req.tool_output == ToolOutput("required") and req.structured_param == "tool_choice"
    assert json.loads(req.params.structured_outputs.spec) == required_schema([WEATHER, TIME]) == {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}}},
             "required": ["name", "parameters"]}]},
        "$defs": {"zone": {"enum": ["UTC", "CET"]}}}
    assert "$defs" in TIME["function"]["parameters"]  # the request's tools are not changed
    named = chat(served, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_output == ToolOutput("named", name="get_weather")
    assert json.loads(named.params.structured_outputs.spec) == WEATHER["function"]["parameters"]
    no_params = {"type": "function", "function": {"name": "ping"}}
    ping = chat(served, tools=[no_params], tool_choice={"type": "function", "function": {"name": "ping"}})
    assert json.loads(ping.params.structured_outputs.spec) == {"type": "object", "properties": {}}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice names function 'nope', which is not in tools (they are get_weather)"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be none, auto, required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.function.name must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "tool_choice constrains the output to tool calls, and response_format constrains it too"),
    ({"tools": {"a": 1}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name",
     "tools[0].function.name must be a non-empty string"),
    ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function", "tools[1].function must be an object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "must be \"function\""),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "'get_weather' names two tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters", "tools[0].function.parameters is not a valid JSON schema"),
    ({"tools": [WEATHER] * 129}, "tools", "tools takes at most 128 functions, got 129"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}, "messages",
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "'image_url' parts are not"),
    ({"functions": [{"name": "f"}]}, "functions", "functions is not supported"),
])
def test_bad_tools_are_400s_naming_the_field(served, body, param, message):
    with pytest.raises(ApiError) as err:
        chat(served, **body)
    assert (err.value.status, err.value.param) == (400, param) and message in err.value.message, err.value.message


json_values = hs.recursive(
    hs.none() | hs.booleans() | hs.integers(-5, 5) | hs.floats(allow_nan=True) | hs.sampled_from(
        ["function", "get_weather", "auto", "required", "none", "object", "string", "{}", '{"a": 1}', "{bad"]),
    lambda inner: hs.lists(inner, max_size=3) | hs.dictionaries(hs.sampled_from(
        ["type", "function", "name", "parameters", "arguments", "properties", "role", "content", "tool_calls",
         "tool_call_id", "$defs", "$ref", "required", "description"]), inner, max_size=4), max_leaves=10)


names = hs.sampled_from(["get_weather", "f", "g", ""])
tool_st = hs.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                    names, json_values | hs.just({"type": "object", "properties": {"a": {"type": "integer"}}}))
tools_st = json_values | hs.lists(tool_st, max_size=3)
choice_st = json_values | hs.sampled_from(["none", "auto", "required"]) | hs.builds(
    lambda name: {"type": "function", "function": {"name": name}}, names)
call_st = hs.builds(lambda name, args: {"id": "c", "type": "function", "function": {"name": name, "arguments": args}},
                    names, json_values)
message_st = hs.just({"role": "tool", "tool_call_id": "c", "content": "x"}) | json_values | hs.builds(
    lambda calls: {"role": "assistant", "content": None, "tool_calls": calls}, json_values | hs.lists(call_st))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(tools=tools_st, choice=choice_st, message=message_st)
def test_any_tools_body_is_served_or_a_400(served, tools, choice, message):
    """Whatever tools, tool_choice and messages hold, parsing answers a request or an ApiError(400), nothing else."""
    body = {"tools": tools, "tool_choice": choice, "messages": [{"role": "user", "content": "hi"}, message]}
    try:
        chat(served, **body)
    except ApiError as exc:
        assert exc.status == 400 and exc.param


def test_auto_needs_the_server_flag_as_vllm(served, tiny_model_dir):
    plain = ServedModel("tiny", 258, 4096, 4, served.tokenizer, tool_call_parser="hermes")
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(ApiError) as err:
            chat(plain, **body)
        assert err.value.param == "tool_choice" and "--enable-auto-tool-choice" in err.value.message
    assert chat(plain, tools=[WEATHER], tool_choice="required").tool_output == ToolOutput("required")
    assert chat(plain, tools=[WEATHER], tool_choice="none").tool_output is None
    no_parser = ServedModel("tiny", 258, 4096, 4, served.tokenizer, enable_auto_tool_choice=True)
    with pytest.raises(ApiError, match="--tool-call-parser"):
        chat(no_parser, tools=[WEATHER])


def test_default_parser_per_family(tmp_path, tiny_model_dir):
    smollm2 = ("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}")
    assert default_parser(tiny_model_dir, smollm2) == "hermes"  # a Llama with ChatML: SmolLM2
    assert default_parser(tiny_model_dir, "<|start_header_id|>{{ m }}<|eot_id|>") == "llama3_json"
    assert default_parser(tiny_model_dir, "[INST] {{ m }} [/INST]") == "mistral"
    for model_type, want in (("qwen3", "hermes"), ("mixtral", "mistral"), ("llama", "llama3_json"), ("gpt_oss", None)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert default_parser(tmp_path, "{{ plain }}") == want


def test_an_unknown_parser_is_refused_at_startup_naming_the_flag(tmp_path, capsys, tiny_model_dir):
    with pytest.raises(ValueError, match=r"tool_call_parser \(--tool-call-parser\) must be one of hermes, "
                                         r"llama3_json, mistral, got 'qwen'"):
        RouterConfig("m", "d", tool_call_parser="qwen")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "dir", "--tool-call-parser", "qwen"])
    assert "argument --tool-call-parser: invalid choice: 'qwen'" in capsys.readouterr().err
    path = tmp_path / "bad.yaml"
    path.write_text(CONFIG.read_text() + "  tool_call_parser: qwen\n")
    with pytest.raises(ConfigError, match=r"router.tool_call_parser: 'qwen' is not a tool-call parser "
                                          r"\(--tool-call-parser\): use one of hermes, llama3_json, mistral"):
        load_config(path, model_path=str(tiny_model_dir))


def test_serve_flags_reach_the_router_config(tmp_path, tiny_model_dir):
    assert PARSER_NAMES == ("hermes", "llama3_json", "mistral")
    args = build_parser().parse_args(["serve", str(tiny_model_dir), "--enable-auto-tool-choice",
                                      "--tool-call-parser", "mistral", "--return-tokens-as-token-ids"])
    data = serve_config(args, free_port=9)
    assert {k: data["router"][k] for k in ("tool_call_parser", "enable_auto_tool_choice",
                                           "return_tokens_as_token_ids")} == {
        "tool_call_parser": "mistral", "enable_auto_tool_choice": True, "return_tokens_as_token_ids": True}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    api = load_config(path).router
    assert (api.tool_call_parser, api.enable_auto_tool_choice, api.return_tokens_as_token_ids) == (
        "mistral", True, True)
    assert load_config(CONFIG, model_path=str(tiny_model_dir)).router.enable_auto_tool_choice is True  # local.yaml: on


# ------------------------------------------------------------------ text and logprobs
def test_sample_text_keeps_only_the_parser_s_special_tokens(served):
    tok = served.tokenizer
    ids = [256, *tok.encode("ab", add_special_tokens=False), 257]  # <s> a b </s>
    keep = SampleText(tok, (), keep_special_ids=frozenset({256}))
    assert keep.push(ids) + keep.flush() == "<s>ab"
    plain = SampleText(tok, ())
    assert plain.push(ids) + plain.flush() == "ab"


def test_top_logprobs_keep_the_most_likely_token_of_a_shared_text(served):
    tok = served.tokenizer
    assert tok.decode([200], skip_special_tokens=False) == tok.decode([201], skip_special_tokens=False) == "\ufffd"
    req = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 2}, served)
    for top in (((200, -0.5), (201, -2.0)), ((201, -2.0), (200, -0.5))):
        body = logprobs_body(req, tok, [200], [TokenLogprobs(-0.5, top)])
        assert body["top_logprobs"] == [{"\ufffd": -0.5}] and body["token_logprobs"] == [-0.5]


def test_return_tokens_as_token_ids(served):
    tok = served.tokenizer
    lps = [TokenLogprobs(-0.5, ((200, -0.5), (201, -2.0))), TokenLogprobs(-1.0, ((97, -1.0),))]
    req = parse_completion({"model": "tiny", "prompt": "x", "logprobs": 2, "return_tokens_as_token_ids": True},
                           served)
    assert logprobs_body(req, tok, [200, 97], lps) == {
        "tokens": ["token_id:200", "token_id:97"], "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"token_id:200": -0.5, "token_id:201": -2.0}, {"token_id:97": -1.0}],
        "text_offset": [0, 1]}  # offsets count the text
    chat_req = chat(served, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    assert logprobs_body(chat_req, tok, [97], lps[1:]) == {"content": [{
        "token": "token_id:97", "logprob": -1.0, "bytes": [97],
        "top_logprobs": [{"token": "token_id:97", "logprob": -1.0, "bytes": [97]}]}]}
    by_default = ServedModel("tiny", 258, 4096, 4, tok, return_tokens_as_token_ids=True)
    assert parse_completion({"model": "tiny", "prompt": "x"}, by_default).tokens_as_ids
    assert not parse_completion({"model": "tiny", "prompt": "x", "return_tokens_as_token_ids": False},
                                by_default).tokens_as_ids


def test_llama3_json_answer_with_a_name_key_is_content_streamed_or_not():
    """A JSON answer that happens to have a "name" (no arguments key) is no call, and a stream gives it as content;
    a hermes call that does not parse streams as content too (review of issue 32)."""
    for parser, text in ((LLAMA, '{"city": "x", "name": "Bob"}'),
                         (HERMES, "Hi <tool_call> oops, never mind. The answer is 4.")):
        assert parser.parse(text) == ParsedOutput(text, ())
        for size in (1, 3, 7):
            stream = parser.stream()
            deltas = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
            assert "".join(d.content for d in deltas) == text and not any(d.calls for d in deltas)
