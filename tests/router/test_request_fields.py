"""Issue 64: vLLM's defaults (max_tokens, generation_config.json) and every vLLM request field honoured or refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvrelay.model.generation_config import GenerationConfigError, GenerationDefaults, load_generation_defaults
from kvrelay.model.tiny import CHAT_TEMPLATE, write_tiny_model
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.router import request_fields
from kvrelay.router.cache_salt import request_salt
from kvrelay.router.openai_api import ApiError, ServedModel, parse_chat, parse_completion, parse_completions
from kvrelay.router.openai_responses import usage
from kvrelay.router.text_output import SampleText

MAX_MODEL_LEN = 128
USER = [{"role": "user", "content": "hi"}]

# vLLM's request fields: vllm/entrypoints/openai/chat_completion/protocol.py and completion/protocol.py at
# d5dba2d7 (ChatCompletionRequest, CompletionRequest), plus best_of and guided_* of the older protocol.py.
VLLM_CHAT_FIELDS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "include_reasoning", "parallel_tool_calls",
    "user", "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count",
    "functions", "function_call",
)
VLLM_COMPLETION_FIELDS = (
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "best_of",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "prompt_embeds", "add_special_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count", "bad_words",
)
# Honoured: a value that does something, which parses.
HONOURED: dict[str, Any] = {
    "messages": USER, "model": "tiny", "prompt": "hi", "frequency_penalty": 0.5, "logit_bias": {"5": 1.0},
    "logprobs": True, "top_logprobs": 2, "max_tokens": 4, "max_completion_tokens": 4, "n": 2, "presence_penalty": 0.5,
    "response_format": {"type": "json_object"}, "seed": 7, "stop": ["x"], "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "none",
    "reasoning_effort": "low", "user": "someone", "best_of": 1, "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.1, "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True,
    "min_tokens": 1, "skip_special_tokens": False, "truncate_prompt_tokens": 3, "allowed_token_ids": [5, 6],
    "bad_words": ["ab"], "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template_kwargs": {"enable_thinking": False},
    "structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"}, "guided_regex": "a+",
    "guided_choice": ["a", "b"], "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "return_tokens_as_token_ids": True, "cache_salt": "s3cret",
    "functions": [], "function_call": "none", "suffix": "", "echo": True, "include_reasoning": False,
    "prompt_logprobs": 2,
}
# Refused: a value other than the neutral one, which must be a 400 naming the field.
REFUSED: dict[str, Any] = {
    "parallel_tool_calls": False, "use_beam_search": True, "length_penalty": 0.5,
    "spaces_between_special_tokens": False, "chat_template": "{{ messages }}",
    "mm_processor_kwargs": {"a": 1}, "structural_tag": "{}", "priority": 1, "request_id": "abc",
    "logits_processors": ["my.Processor"], "return_token_ids": True, "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1}, "max_repetition_pattern_size": 4, "min_repetition_pattern_size": 2,
    "repetition_min_count": 3, "prompt_embeds": "AAAA", "best_of": 2, "suffix": "end", "functions": [{"name": "f"}],
    "function_call": "auto", "echo": True,
}
COMPLETION_VALUES: dict[str, Any] = {"logprobs": 2, "prompt": [5, 6]}  # where completions take another type


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> ServedModel:
    return ServedModel("tiny", 258, MAX_MODEL_LEN, 4, load_tokenizer(tiny_model_dir), eos_token_ids=(257,))


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> ServedModel:
    """The tiny model with a chat template that reads Qwen3's ``enable_thinking`` and ``documents``."""
    model = write_tiny_model(tmp_path_factory.mktemp("thinking") / "model", seed=0)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}<no-think>"
                               "{% endif %}{% for d in documents or [] %}[{{ d.title }}]{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return ServedModel("tiny", 258, MAX_MODEL_LEN, 4, load_tokenizer(model), eos_token_ids=(257,))


def chat(served: ServedModel, **fields: Any):
    return parse_chat({"model": "tiny", "messages": USER, **fields}, served)


def refused(parse, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


# ----------------------------------------------------------------------------------------------- defaults
def test_chat_without_max_tokens_gets_the_rest_of_the_context(served):
    req = chat(served)
    assert len(req.prompt_token_ids) == 27  # "<s><|user|>\nhi\n<|assistant|>\n": BOS + 26 bytes
    assert req.params.max_tokens == MAX_MODEL_LEN - 27
    assert chat(served, max_completion_tokens=9).params.max_tokens == 9
    assert chat(served, max_tokens=7, max_completion_tokens=9).params.max_tokens == 7


def test_completions_keep_16_or_what_the_context_leaves(served):
    assert parse_completion({"model": "tiny", "prompt": [1] * 10}, served).params.max_tokens == 16
    assert parse_completion({"model": "tiny", "prompt": [1] * 120}, served).params.max_tokens == 8
    err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": [1] * MAX_MODEL_LEN})
    assert err.message.startswith("this model's context window is 128 tokens and the prompt has 128: no room")


def test_the_generation_config_fills_what_the_request_leaves_out(tiny_model_dir):
    defaults = GenerationDefaults(temperature=0.6, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.1,
                                  max_tokens=10, eos_token_ids=(257, 5))
    served = ServedModel("tiny", 258, MAX_MODEL_LEN, 4, load_tokenizer(tiny_model_dir), defaults=defaults,
                         eos_token_ids=(257,))
    p = chat(served).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.8, 20, 0.05,
                                                                                               1.1, 10)
    assert p.stop_token_ids == (5,)  # the engine stops on 257 already
    p = chat(served, temperature=0.2, top_k=0, max_tokens=50, stop_token_ids=[7], ignore_eos=True).params
    assert (p.temperature, p.top_k, p.max_tokens, p.stop_token_ids) == (0.2, 0, 50, (7,))
    assert chat(served, stop_token_ids=[7]).params.stop_token_ids == (7, 5)
    assert parse_completion({"model": "tiny", "prompt": "x"}, served).params.max_tokens == 16  # completions: 16


def test_generation_config_json_is_read_as_vllm_reads_it(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0, "max_new_tokens": 5,
        "eos_token_id": [1, 2], "do_sample": True}))
    got = load_generation_defaults(tmp_path, "auto")
    # top_k 50 and repetition_penalty 1.0 are transformers' defaults: vLLM reads the file's diff from them
    assert got == GenerationDefaults(temperature=0.7, top_p=0.9, max_tokens=5, eos_token_ids=(1, 2),
                                     applied=(("max_tokens", 5), ("temperature", 0.7), ("top_p", 0.9),
                                              ("eos_token_id", [1, 2])))
    assert load_generation_defaults(tmp_path, "vllm") == GenerationDefaults()
    assert load_generation_defaults(tmp_path / "none", "auto") == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 3.0}))
    with pytest.raises(GenerationConfigError, match="temperature 3.0 is out of range; fix it or serve with "
                                                    "--generation-config vllm"):
        load_generation_defaults(tmp_path, "auto")
    with pytest.raises(ValueError, match="must be one of auto, vllm, got 'hf'"):
        load_generation_defaults(tmp_path, "hf")


# ------------------------------------------------------------------------------------ the chat template
def test_chat_template_inputs_reach_the_template(thinking):
    tok = thinking.tokenizer
    assert tok is not None

    def text(**fields: Any) -> str:
        return tok.decode(chat(thinking, **fields).prompt_token_ids, skip_special_tokens=False)

    assert text() == "<s><|user|>\nhi\n<|assistant|>\n"
    assert text(chat_template_kwargs={"enable_thinking": False}) == "<s><|user|>\nhi\n<|assistant|>\n<no-think>"
    assert text(documents=[{"title": "A"}, {"title": "B"}]) == "<s><|user|>\nhi\n<|assistant|>\n[A][B]"
    assert text(add_generation_prompt=False) == "<s><|user|>\nhi\n"
    messages = [*USER, {"role": "assistant", "content": "Sure, "}]
    assert text(messages=messages, add_generation_prompt=False, continue_final_message=True) == \
        "<s><|user|>\nhi\n<|assistant|>\nSure,"
    assert text(add_special_tokens=True) == "<s><s><|user|>\nhi\n<|assistant|>\n"
    err = refused(lambda b: parse_chat(b, thinking), {"model": "tiny", "messages": USER,
                                                       "continue_final_message": True})
    assert (err.param, err.message) == ("continue_final_message", "continue_final_message continues the last "
                                        "message, so it needs add_generation_prompt: false")
    err = refused(lambda b: parse_chat(b, thinking), {"model": "tiny", "messages": USER,
                                                       "chat_template_kwargs": {"messages": []}})
    assert (err.param, err.message) == ("chat_template_kwargs", "chat_template_kwargs may not set 'messages': the "
                                        "server passes it")


# ------------------------------------------------------------------------------------- sampling fields
def test_bad_words_allowed_ids_and_truncation_reach_the_params(served):
    p = chat(served, bad_words=["ab", " c"], allowed_token_ids=[6, 5, 6]).params
    # vLLM adds the spaced form only where it is as many tokens with another first one (not so for bytes)
    assert p.bad_words_token_ids == ((97, 98), (99,))
    assert p.allowed_token_ids == (6, 5)
    req = parse_completion({"model": "tiny", "prompt": list(range(1, 11)), "truncate_prompt_tokens": 4}, served)
    assert req.prompt_token_ids == [7, 8, 9, 10]
    err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": [1] * 200,
                                                          "truncate_prompt_tokens": -1})
    assert err.message.startswith("this model's context window is 128 tokens and the prompt has 128: no room")
    assert parse_completion({"model": "tiny", "prompt": [1] * 100, "truncate_prompt_tokens": -1},
                            served).prompt_token_ids == [1] * 100
    err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": "x", "allowed_token_ids": [258]})
    assert (err.param, err.message) == ("allowed_token_ids", "allowed_token_ids: 258 is not a token id in [0, 258)")
    err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": "x", "truncate_prompt_tokens": 0})
    assert err.param == "truncate_prompt_tokens"


def test_output_fields_and_cache_salt(served):
    req = chat(served, skip_special_tokens=False, include_stop_str_in_output=True, cache_salt="abc")
    assert (req.skip_special_tokens, req.include_stop_str_in_output, req.cache_salt) == (False, True, "abc")
    tok = served.tokenizer
    text = SampleText(tok, ("lo",), include_stop=True)
    assert text.push(tok.encode("hello world", add_special_tokens=False)) == "hello" and text.stopped
    text = SampleText(tok, ("lo",))
    assert text.push(tok.encode("hello world", add_special_tokens=False)) == "hel"
    text = SampleText(tok, (), skip_special_tokens=False)
    assert text.push([256, 65, 257]) + text.flush() == "<s>A</s>"
    assert SampleText(tok, ()).push([256, 65, 257]) == "A"


def test_a_cache_salt_only_splits_its_own_tenants_cache():
    tenant_a, tenant_b = bytes(16), bytes([1]) * 16
    assert request_salt(tenant_a, None) == tenant_a and request_salt(b"", None) == b""
    salted = request_salt(tenant_a, "x")
    assert len(salted) == 16 and salted == request_salt(tenant_a, "x")
    assert len({salted, request_salt(tenant_b, "x"), request_salt(tenant_a, "y"), request_salt(b"", "x"),
                tenant_a}) == 5


def test_usage_carries_cached_tokens():
    assert usage(10, 2, 8) == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                               "prompt_tokens_details": {"cached_tokens": 8}}


# ------------------------------------------------------------------------- every vLLM field, walked
def test_every_vllm_field_is_honoured_or_refused_with_a_400_naming_it(served, thinking):
    """Each field of vLLM's two request models: honoured (a working value, or the neutral one of a field refused at
    any other, parses), or refused (a value other than its neutral one is a 400 whose param names it). A field in
    neither list fails the test."""
    for endpoint, fields in (("chat", VLLM_CHAT_FIELDS), ("completion", VLLM_COMPLETION_FIELDS)):
        is_chat = endpoint == "chat"
        base = {"model": "tiny", **({"messages": USER} if is_chat else {"prompt": "hi"})}

        def parse(body: dict[str, Any], is_chat: bool = is_chat) -> None:
            if is_chat:
                parse_chat(body, thinking)
            else:
                parse_completions(body, served)

        for name in fields:
            honoured = name in HONOURED and not (is_chat and name == "echo")
            refused_here = name in REFUSED and not (not is_chat and name == "echo")
            assert honoured or refused_here, f"{endpoint}: vLLM's {name} is neither honoured nor refused"
            if honoured:
                body = {**base, name: (COMPLETION_VALUES if not is_chat else {}).get(name, HONOURED[name])}
                if name == "continue_final_message":
                    body["add_generation_prompt"] = False
                if name == "top_logprobs":
                    body["logprobs"] = True
                if name == "tools":
                    body["tool_choice"] = "none"
                parse(body)  # raises ApiError if refused
            if refused_here:
                err = refused(parse, {**base, name: REFUSED[name]})
                assert err.param == name and name in err.message, (endpoint, name, err.message)
    for name in ("chat_template_kwargs", "continue_final_message", "documents", "reasoning_effort",
                 "add_generation_prompt"):
        err = refused(lambda b: parse_completions(b, served), {"model": "tiny", "prompt": "hi", name: HONOURED[name]})
        assert (err.param, err.message) == (name, f"{name} applies to chat templates; send it to "
                                                  "/v1/chat/completions")


def test_refusals_say_why(served):
    err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": "hi", "priority": 3})
    assert err.message == ("priority is not supported by this server (only 0 is accepted): the router's queue "
                           "serves tenants round robin and has no priorities")
    assert parse_completion({"model": "tiny", "prompt": "hi", "priority": 0, "use_beam_search": False},
                            served).params.max_tokens == 16
    err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": "hi", "use_beam_search": 0})
    assert err.param == "use_beam_search"  # 0 is not false


def test_prompt_logprobs_are_honoured_within_vllms_bounds(served, monkeypatch):
    """Issue 64: vLLM's prompt_logprobs reach the engine's params; what vLLM refuses, and what the prefill node's
    reply could not carry, is a 400 naming the field."""
    def completion(**fields: Any):
        return parse_completion({"model": "tiny", "prompt": [5, 6, 7], **fields}, served)

    assert completion().params.prompt_logprobs is None
    assert completion(prompt_logprobs=0).params.prompt_logprobs == 0
    assert chat(served, prompt_logprobs=20).params.prompt_logprobs == 20
    assert completion(prompt_logprobs=0, stream=True).params.prompt_logprobs is None  # a stream carries none
    for value, message in [
        (21, "prompt_logprobs 21 is over the most this server answers, 20"),
        (-1, "prompt_logprobs -1 (the whole vocabulary, 258 tokens) is over the most this server answers, 20"),
        (-2, "prompt_logprobs must be a positive value or -1, got -2"),
        (True, "prompt_logprobs must be an integer, got bool"),
        (1.5, "prompt_logprobs must be an integer, got float"),
    ]:
        err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": "hi",
                                                             "prompt_logprobs": value})
        assert (err.status, err.param, err.message) == (400, "prompt_logprobs", message)
    err = refused(lambda b: parse_chat(b, served), {"model": "tiny", "messages": USER, "prompt_logprobs": 1,
                                                    "stream": True})
    assert (err.param, err.message) == ("prompt_logprobs", "prompt_logprobs are not available when stream is true; "
                                                           "ask without stream")
    monkeypatch.setattr(request_fields, "MAX_PROMPT_LOGPROB_VALUES", 8)
    assert completion(prompt_logprobs=3).params.prompt_logprobs == 3  # 2 positions × 4 logprobs
    err = refused(lambda b: parse_completion(b, served), {"model": "tiny", "prompt": [5, 6, 7], "prompt_logprobs": 4})
    assert err.message == ("prompt_logprobs 4 for a prompt of 3 tokens would answer 10 logprobs, over the most, 8; "
                           "ask for fewer alternatives or send a shorter prompt")
