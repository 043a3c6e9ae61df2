"""Issue 64: gpt-oss chat in the harmony format through a real deployment (router, prefill and decode nodes), read
with the official ``openai`` client.

The model is a tiny gpt_oss whose vocabulary is gpt-oss's size and whose weights are a bigram table: its attention
and experts write nothing back (their output projections are zero), so each next token is a function of the current
one alone (``lm_head · norm(embedding)``). Greedy, its output from harmony's prompt (which ends ``<|start|>assistant``)
is one fixed path through `NEXT`; where a token has a runner-up, a request's ``logit_bias`` of +2 takes that branch
instead (every other token stays 10 below the winner, so the bias changes nothing else). So each answer's harmony
output — and with it its reasoning, content and tool calls — is known token by token.
"""

from __future__ import annotations

import pytest
import torch
from kvrelay.model.tiny import write_tiny_model
from kvrelay.router.harmony import load_encoding, render_chat
from kvrelay.router.harmony_vocab import default_cache_dir, encodings_dir
from safetensors.torch import load_file, save_file

from tests.services.cluster import Cluster
from tests.services.test_reasoning_api import _post

openai = pytest.importorskip("openai")

GPT_OSS_VOCAB = 201088
HIDDEN = 64
# token → (winner, runner-up or None), as text in o200k (specials are harmony's); one token each
NEXT = {
    "assistant": ("<|channel|>", None),
    "<|channel|>": ("analysis", "final"),  # "comment" too: a second runner-up, below
    "analysis": ("<|message|>", None), "final": ("<|message|>", None),
    "comment": ("ary", None), "ary": (" to", None), " to": ("=", None), "=": ("functions", None),
    "functions": (".get", None), ".get": ("_weather", None), "_weather": (" json", None),
    " json": ("<|message|>", None),
    "<|message|>": ("Need", '{"'), "Need": (" weather", None), " weather": ("<|end|>", "<|return|>"),
    "<|end|>": ("<|start|>", None), "<|start|>": ("assistant", None),
    '{"': ("city", None), "city": ('":"', None), '":"': ("Paris", None), "Paris": ('"}', None),
    '"}': ("<|call|>", None),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def enc():
    return load_encoding(encodings_dir(None, cache_dir=default_cache_dir()))


def _id(enc, text: str) -> int:
    ids = enc.encode(text, allowed_special="all")
    assert len(ids) == 1, (text, ids)
    return ids[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, enc):
    model = write_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "model", arch="gpt-oss", vocab=GPT_OSS_VOCAB,
                             hidden=HIDDEN, layers=2)
    weights = load_file(str(model / "model.safetensors"))
    for name in weights:  # attention and experts add nothing to the residual stream
        if name.endswith(("o_proj.weight", "o_proj.bias", "experts.down_proj", "experts.down_proj_bias")):
            weights[name] = torch.zeros_like(weights[name])
    embed = torch.zeros(GPT_OSS_VOCAB, HIDDEN)
    head = torch.zeros(GPT_OSS_VOCAB, HIDDEN)
    tokens = sorted({t for k, (w, r) in NEXT.items() for t in (k, w, r) if t is not None} | {"comment"})
    row = {t: k for k, t in enumerate(tokens)}
    assert len(row) <= HIDDEN
    scale = HIDDEN ** -0.5  # the final RMSNorm scales a one-hot row by sqrt(HIDDEN)
    for text, (winner, runner_up) in NEXT.items():
        embed[_id(enc, text), row[text]] = 1.0
        head[_id(enc, winner), row[text]] = 10.0 * scale
        if runner_up is not None:
            head[_id(enc, runner_up), row[text]] = 9.0 * scale
    head[_id(enc, "comment"), row["<|channel|>"]] = 9.0 * scale
    weights.update({"model.embed_tokens.weight": embed, "lm_head.weight": head,
                    "model.norm.weight": torch.ones(HIDDEN)})
    save_file(weights, str(model / "model.safetensors"))
    with Cluster(model, overrides={"router": {"enable_auto_tool_choice": True}}) as c:
        yield c


def _client(cluster: Cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _bias(enc, *texts: str) -> dict[str, float]:
    return {str(_id(enc, t)): 2.0 for t in texts}


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def test_the_prompt_is_harmonys_rendering(cluster: Cluster, enc) -> None:
    got = _post(cluster.url, "/tokenize", {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]})["tokens"]
    assert got == render_chat(enc, {"messages": MESSAGES, "tools": [WEATHER]}, auto_tools=True).token_ids


def test_analysis_is_reasoning_and_final_is_content(cluster: Cluster, enc) -> None:
    client = _client(cluster)
    thought = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                             logit_bias=_bias(enc, "<|return|>"))
    choice = thought.choices[0]  # <|channel|>analysis<|message|>Need weather<|return|>
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == (
        "Need weather", None, "stop")
    assert thought.usage.completion_tokens == 6
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                            logit_bias=_bias(enc, "final", "<|return|>"))
    choice = answer.choices[0]  # <|channel|>final<|message|>Need weather<|return|>
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == (
        None, "Need weather", "stop")
    # no <|return|> runner-up taken: two analysis messages, then cut off by max_tokens
    long = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=14, temperature=0).choices[0]
    assert (long.message.reasoning_content, long.message.content, long.finish_reason) == (
        "Need weather\nNeed weather", None, "length")
    streamed = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=14, temperature=0,
                                              stream=True)
    deltas = [(c.choices[0].delta, c.choices[0].finish_reason) for c in streamed if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d, _ in deltas) == "Need weather\nNeed weather"
    assert not any(d.content for d, _ in deltas) and deltas[-1][1] == "length"


def test_a_function_call_is_a_tool_call_whole_and_streamed(cluster: Cluster, enc) -> None:
    client = _client(cluster)
    bias = _bias(enc, "comment", '{"')
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=30,
                                         temperature=0, logit_bias=bias)
    choice = out.choices[0]  # <|channel|>commentary to=functions.get_weather json<|message|>{"city":"Paris"}<|call|>
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city":"Paris"}')]
    assert out.usage.completion_tokens == 16
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=30,
                                            temperature=0, logit_bias=bias, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    calls = [tc for ch in chunks for tc in (ch.delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert all(tc.index == 0 for tc in calls) and all(tc.id is None for tc in calls[1:])
    assert "".join(tc.function.arguments or "" for tc in calls) == '{"city":"Paris"}'
    assert chunks[-1].finish_reason == "tool_calls" and not any(ch.delta.content for ch in chunks)
    # a request field no harmony prompt reads is refused, naming it
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs does not apply"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"x": 1}})
    # completions are not harmony: the text is the tokenizer's, the ids are the bigram's
    text = client.completions.create(model="tiny", prompt=[_id(enc, "<|message|>")], max_tokens=2, temperature=0,
                                     logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert text.choices[0].logprobs.tokens == [f"token_id:{_id(enc, 'Need')}", f"token_id:{_id(enc, ' weather')}"]
