"""Issue 64 through a real deployment: vLLM's defaults (max_tokens, generation_config.json), cached_tokens, vLLM's
sampling fields, /version."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import openai
import pytest

from tests.services.cluster import Cluster, get_json

MAX_MODEL_LEN = 128
BLOCK = 16  # deploy/configs/local.yaml's kvstore.block_size_tokens


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model whose generation_config.json asks for greedy decoding (temperature 0)."""
    out = tmp_path_factory.mktemp("greedy") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    return out


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(model_dir, overrides={"engine": {"max_model_len": MAX_MODEL_LEN}}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_without_max_tokens_fills_the_context_with_the_models_default_temperature(client):
    messages = [{"role": "user", "content": "Tell me everything."}]
    out = client.chat.completions.create(model="tiny", messages=messages, extra_body={"ignore_eos": True})
    prompt = out.usage.prompt_tokens
    assert prompt == 44  # "<s><|user|>\nTell me everything.\n<|assistant|>\n"
    assert out.usage.completion_tokens == MAX_MODEL_LEN - prompt
    assert out.choices[0].finish_reason == "length"
    # generation_config.json's temperature 0 is the default: unseeded, the same text every time, the greedy one
    again = client.chat.completions.create(model="tiny", messages=messages, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                            max_tokens=MAX_MODEL_LEN - prompt, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == again.choices[0].message.content == greedy.choices[0].message.content
    # completions keep 16
    text = client.completions.create(model="tiny", prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 16


def test_cached_tokens_are_the_cached_prefixs_whole_blocks(client):
    prompt = list(range(1, 101))  # 100 tokens: 6 whole blocks

    def cached(**fields) -> int:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **fields)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() == 6 * BLOCK
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 6 * BLOCK
    # a cache_salt keys the prompt's blocks apart: its first request finds none
    assert cached(extra_body={"cache_salt": "tenant-secret"}) == 0
    assert cached(extra_body={"cache_salt": "tenant-secret"}) == 6 * BLOCK
    assert cached(extra_body={"cache_salt": "another"}) == 0
    messages = [{"role": "user", "content": "x" * 60}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens == 85  # whole blocks of it: 5
    assert (first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens) == \
        (0, 5 * BLOCK)


def test_allowed_token_ids_bad_words_and_stop_strings_kept(client):
    def text(**fields) -> str:
        out = client.completions.create(model="tiny", prompt="Hi", max_tokens=5,
                                        extra_body={"ignore_eos": True, **fields})
        return out.choices[0].text

    assert text(allowed_token_ids=[65]) == "AAAAA"
    assert text(allowed_token_ids=[65, 66], bad_words=["A"]) == "BBBBB"
    assert text(allowed_token_ids=[65], stop=["AA"], include_stop_str_in_output=True) == "AA"
    assert text(allowed_token_ids=[65], stop=["AA"]) == ""


@pytest.fixture(scope="module")
def reference(model_dir):
    """``reference(ids) -> [P, vocab]``: transformers' float32 log_softmax at each position of a prompt."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def check_prompt_logprobs(answered: list, prompt: list[int], want, top: int) -> None:
    """``answered`` is vLLM's prompt_logprobs of ``prompt`` with ``top`` alternatives: within 1e-4 of the float32
    reference's logprobs (`want`), with its exact ranks and top token ids."""
    import torch

    assert len(answered) == len(prompt) and answered[0] is None
    for p in range(1, len(prompt)):
        row, tok = want[p - 1], prompt[p]
        top_k = torch.topk(row, top)
        entry = answered[p]
        assert list(entry)[0] == str(tok)  # the prompt's token first, then the top alternatives
        assert set(entry) == {str(tok), *map(str, top_k.indices.tolist())}
        assert entry[str(tok)]["logprob"] == pytest.approx(float(row[tok]), abs=1e-4)
        if str(tok) not in map(str, top_k.indices.tolist()):
            assert entry[str(tok)]["rank"] == int((row >= row[tok]).sum())
        for rank, (t, v) in enumerate(zip(top_k.indices.tolist(), top_k.values.tolist(), strict=True), start=1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
            if 32 <= t < 127:  # the byte-level tokenizer's printable ASCII tokens
                assert entry[str(t)]["decoded_token"] == chr(t)


def test_prompt_logprobs_through_prefill_and_decode_nodes_equal_the_reference(client, reference):
    """Issue 64: vLLM's prompt_logprobs, computed by the prefill node (its prompt's cached blocks notwithstanding)
    and answered in vLLM's shape, equal transformers' log_softmax over the prompt within 1e-4 (both float32)."""
    prompt = [(11 * i + 5) % 120 + 1 for i in range(40)]  # 40 tokens: two whole blocks
    want = reference(prompt)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, n=2, temperature=1.0, seed=3,
                                      extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    assert first.usage.completion_tokens == 6  # the decode node's, after the prefill node's first tokens
    answered = first.choices[0].model_extra["prompt_logprobs"]
    check_prompt_logprobs(answered, prompt, want, 2)
    assert first.choices[1].model_extra["prompt_logprobs"] == answered  # each choice carries its prompt's
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                      extra_body={"prompt_logprobs": 2})
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # computed again, not read from the cache
    assert again.choices[0].model_extra["prompt_logprobs"] == answered
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    assert plain.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None

    messages = [{"role": "user", "content": "Tell me"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    chat_logprobs = chat.model_extra["prompt_logprobs"]  # on the answer, not on a choice
    assert len(chat_logprobs) == chat.usage.prompt_tokens and chat_logprobs[0] is None
    assert all(len(e) == 1 for e in chat_logprobs[1:])  # 0: the prompt's token alone
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 21})
    assert info.value.body["param"] == "prompt_logprobs" and "over the most this server answers, 20" in \
        info.value.body["message"]


def test_version(cluster):
    assert get_json(cluster.url + "/version") == {"version": importlib.metadata.version("kvrelay")}
