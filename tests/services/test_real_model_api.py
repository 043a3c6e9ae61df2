"""SmolLM2-135M-Instruct served by `kvrelay up` (1 prefill + 1 decode), asked through the official client."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.real_model import RealModel
from tests.services.cluster import Cluster

MODEL = "smollm2-135m-instruct"
TEXTS = ["The capital of France is", "  naïve café — 日本語 😀🎉\n\n\ttabs  and   spaces ", "2024-11-30: 12345 + 678"]


@pytest.fixture(scope="module")
def cluster(smollm2: RealModel):
    with Cluster(smollm2.model_dir, overrides={"model": {"name": MODEL, "dtype": "float32"}}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_factual_chat_question_gets_the_right_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop"  # the model ends its answer with <|im_end|>
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer


def test_prompt_tokens_equal_transformers_for_text_and_chat(client: openai.OpenAI, smollm2: RealModel) -> None:
    hf = AutoTokenizer.from_pretrained(smollm2.model_dir)
    for text in TEXTS:
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
        assert out.usage.prompt_tokens == len(hf(text).input_ids), text
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": TEXTS[1]}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert out.usage.prompt_tokens == len(ids)


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    prompt = "Write one sentence about the sea, with an emoji: "
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == full.choices[0].text
    assert chunks[-1].finish_reason == full.choices[0].finish_reason
