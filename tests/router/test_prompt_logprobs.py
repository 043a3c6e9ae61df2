"""Issue 64: vLLM's ``prompt_logprobs`` answer shape (`router.prompt_logprobs`)."""

from __future__ import annotations

import json

import pytest
from kvrelay.model.sampling_params import PromptTokenLogprobs
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.router.prompt_logprobs import add_prompt_logprobs, prompt_logprobs_body


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)  # byte level: token id b is byte b


def test_each_position_maps_the_prompt_token_then_the_top_alternatives(tokenizer):
    prompt = [104, 105, 33, 257]  # "hi!" and EOS
    entries = [PromptTokenLogprobs(-2.5, 3, ((97, -0.5), (98, -1.0))),
               PromptTokenLogprobs(-0.25, 1, ((33, -0.25), (97, -3.0))),  # the prompt's token is the top one
               PromptTokenLogprobs(float("-inf"), 258, ())]
    body = prompt_logprobs_body(tokenizer, prompt, entries)
    assert body == [
        None,
        {"105": {"logprob": -2.5, "rank": 3, "decoded_token": "i"},
         "97": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
         "98": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}},
        {"33": {"logprob": -0.25, "rank": 1, "decoded_token": "!"},
         "97": {"logprob": -3.0, "rank": 2, "decoded_token": "a"}},
        {"257": {"logprob": -9999.0, "rank": 258, "decoded_token": tokenizer.decode([257], skip_special_tokens=False)}},
    ]
    assert [list(p) for p in body[1:]] == [["105", "97", "98"], ["33", "97"], ["257"]]  # the prompt's token first
    json.dumps(body, allow_nan=False)  # no infinity reaches the client
    assert prompt_logprobs_body(None, [5, 6], [PromptTokenLogprobs(-1.0, 2, ())]) == [
        None, {"6": {"logprob": -1.0, "rank": 2, "decoded_token": None}}]
    assert prompt_logprobs_body(tokenizer, [5], []) == [None]
    with pytest.raises(ValueError, match="2 prompt logprobs for a prompt of 2 tokens"):
        prompt_logprobs_body(tokenizer, [5, 6], entries[:2])


def test_completions_put_them_on_each_choice_and_chat_on_the_answer():
    a, b = [None, {"6": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}], [None]
    completion = {"choices": [{"index": 0}, {"index": 1}, {"index": 2}]}
    add_prompt_logprobs(completion, "completion", [a, a, b])  # n=2 of one prompt, then a second prompt
    assert [c["prompt_logprobs"] for c in completion["choices"]] == [a, a, b]
    chat = {"choices": [{"index": 0}, {"index": 1}]}
    add_prompt_logprobs(chat, "chat", [a, a])
    assert chat == {"choices": [{"index": 0}, {"index": 1}], "prompt_logprobs": a}
    untouched = {"choices": [{"index": 0}]}
    add_prompt_logprobs(untouched, "completion", [None])
    assert untouched == {"choices": [{"index": 0}]}
