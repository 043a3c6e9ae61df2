"""The OpenAI-compatible API through `kvrelay up` (router + prefill + decode processes on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer

from tests.services.cluster import Cluster, get_json

API_KEY = "sk-test-1"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with Cluster(tiny_model_dir,
                 overrides={"router": {"api_keys": [API_KEY], "max_body_bytes": "64KiB", "max_n": 3}}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def reference_text(model_dir, prompt_ids: list[int], max_tokens: int) -> str:
    engine = LLMEngine(load_model(model_dir), EngineConfig(num_blocks=256))
    [[ids]] = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))
    return load_tokenizer(model_dir).decode(ids)


def post(cluster, path: str, body: bytes, *, key: str | None = API_KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(cluster.url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_completions_stream_and_not_equal_generate(cluster, client, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    want = reference_text(tiny_model_dir, tok.encode(prompt), 24)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens == len(tok.encode(prompt)) and out.usage.completion_tokens == 24
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 24
    ids = tok.encode("token ids work too")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == reference_text(tiny_model_dir, ids, 10)


def test_chat_stream_and_not(client, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    want = reference_text(tiny_model_dir, ids, 16)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == want


def test_n_seed_and_stop(client):
    a = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=1.0, seed=7, n=3)
    b = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=1.0, seed=7, n=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    full = client.completions.create(model="tiny", prompt="xyz", max_tokens=20, temperature=0).choices[0].text
    stop = full[5:7]
    cut = client.completions.create(model="tiny", prompt="xyz", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "tiny", "prompt": [1] * 2100, "max_tokens": 1}, 400, "context window"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ({"model": "tiny", "prompt": "x", "n": 4}, 400, "n must be between 1 and 3"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature must be in [0, 2]"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop takes at most 4"),
        ({"model": "tiny", "prompt": [5, 999]}, 400, "token id 999 at position 1 is outside the vocabulary"),
        ({"model": "nope", "prompt": "x"}, 404, "model 'nope' not found"),
    ],
)
def test_bad_requests_get_named_errors(cluster, body, status, message):
    code, err = post(cluster, "/v1/completions", json.dumps(body).encode())
    assert code == status and message in err["error"]["message"]
    assert get_json(cluster.url + "/health")["status"] == "ok"


def test_malformed_bodies_and_auth(cluster):
    assert post(cluster, "/v1/completions", b"{not json")[0] == 400
    code, err = post(cluster, "/v1/completions", b"[1, 2]")
    assert code == 400 and "JSON object" in err["error"]["message"]
    code, err = post(cluster, "/v1/completions", b'{"model": "tiny", "prompt": "' + b"a" * 70000 + b'"}')
    assert code == 413 and "65536-byte limit" in err["error"]["message"]
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
    assert post(cluster, "/v1/completions", body, key=None)[0] == 401
    code, err = post(cluster, "/v1/completions", body, key="sk-wrong")
    assert code == 401 and "API key" in err["error"]["message"]
    models = get_json(cluster.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert get_json(cluster.url + "/health")["status"] == "ok"


def test_bad_yaml_fails_at_start_naming_the_key(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {{path: {tiny_model_dir}}}\nkvstore: {{device: {{bytes: 8GB}}}}\n")
    run = subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", "up", "--config", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert "kvstore.device.bytes: '8GB' is not a size" in run.stderr and "Traceback" not in run.stderr
    bad.write_text(f"model: {{path: {tiny_model_dir}}}\nkvstore: {{device: {{bytes: 8MiB}}}}\nrouter: {{prot: 9}}\n")
    run = subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", "up", "--config", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "router.prot: unknown key" in run.stderr


def test_penalties_min_tokens_and_logit_bias_reach_the_engines(client, tiny_model_dir):
    """Issue 15: the sampling knobs vLLM users send go through router, prefill and decode (the first
    token is sampled on the prefill node, the rest on the decode node) and give the engine's tokens."""
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("abcabcabc abcabc")
    params = SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2,
                            min_tokens=4, logit_bias=((ord("q") + 2, 3.0),))
    engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=256))
    [[want]] = engine.generate([ids], params)
    [[plain]] = engine.generate([ids], SamplingParams(max_tokens=16))
    assert want != plain
    out = client.completions.create(
        model="tiny", prompt=ids, max_tokens=16, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
        logit_bias={str(ord("q") + 2): 3}, extra_body={"repetition_penalty": 1.2, "min_tokens": 4})
    assert out.choices[0].text == tok.decode(want) and out.usage.completion_tokens == len(want)


def test_logprobs_through_prefill_and_decode_equal_the_engine_s(client, tiny_model_dir):
    """Issue 15: the first token's logprobs come from the prefill node, the rest from the decode node;
    completions (plain and streamed) and chat carry them in OpenAI's shapes."""
    from tests.model.test_logprobs import run_with_logprobs

    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode("logprobs, please")
    engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=256))
    want_ids, want = run_with_logprobs(engine, ids, SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True))

    out = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want_ids]
    # A dict per token, keyed by text (OpenAI's shape: tokens with the same text share a key, which keeps the most
    # likely one's logprob: issue 32).
    text = {t: tok.decode([t], skip_special_tokens=False) for w in want for t, _ in w.top}
    by_text = [{text[t]: v for t, v in reversed(w.top)} for w in want]  # best first: the best one written last
    assert lp.top_logprobs == [pytest.approx(d, abs=1e-4) for d in by_text]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]

    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([w.logprob for w in want], abs=1e-4)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6) for c in content)  # greedy: the top
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_several_prompts_in_one_request_equal_one_request_each(client, tiny_model_dir):
    """Issue 15: a list of prompts gives each prompt its own choices (index = prompt · n + sample), the
    same as asking one by one; streamed too; usage counts every prompt."""
    prompts = ["first prompt", "the second one", "and a third"]
    one_by_one = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=1.0, seed=4, n=2)
                  for p in prompts]
    together = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=1.0, seed=4, n=2)
    assert [c.index for c in together.choices] == list(range(6))
    assert [c.text for c in together.choices] == [c.text for r in one_by_one for c in r.choices]
    assert together.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in one_by_one)
    assert together.usage.completion_tokens == sum(r.usage.completion_tokens for r in one_by_one)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=1.0, seed=4, n=2,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(6)] == [c.text for c in together.choices]


def test_echo_tokenize_and_detokenize(cluster, client, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    plain = client.completions.create(model="tiny", prompt="echo me", max_tokens=5, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="echo me", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "echo me" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="echo me", max_tokens=5, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    code, body = post(cluster, "/tokenize", json.dumps({"model": "tiny", "prompt": "count these"}).encode())
    assert code == 200 and body["tokens"] == tok.encode("count these") and body["count"] == len(body["tokens"])
    code, body = post(cluster, "/detokenize", json.dumps({"model": "tiny", "tokens": body["tokens"]}).encode())
    assert code == 200 and body["prompt"] == tok.decode(tok.encode("count these"))
    code, body = post(cluster, "/tokenize", json.dumps({"model": "tiny", "prompt": "x"}).encode(), key=None)
    assert code == 401


def test_the_offline_llm_gives_the_server_s_tokens_for_the_same_seed(client, tiny_model_dir):
    from kvrelay import LLM

    llm = LLM(model=tiny_model_dir, dtype="float32", kv_cache_memory="8MiB")
    try:
        [offline] = llm.generate("same seed, same words", SamplingParams(max_tokens=12, temperature=1.0, seed=21, n=2),
                                 use_tqdm=False)
    finally:
        llm.close()
    served = client.completions.create(model="tiny", prompt="same seed, same words", max_tokens=12, temperature=1.0,
                                       seed=21, n=2)
    assert [c.text for c in served.choices] == [o.text for o in offline.outputs]


def test_forced_continuation_bytes_stream_as_they_come(client):
    """Issue 30 (3 of 9): ``logit_bias`` forcing UTF-8 continuation byte 0x80 (the tiny tokenizer's id
    128) for 2,000 tokens. The old decoder held all of it back (every SSE event empty, the last one
    with all 2,000 characters), re-decoding the held ids per token; now each byte's U+FFFD goes out
    with the event of its token, and the streamed text equals the non-streamed one."""
    kwargs = {"model": "tiny", "prompt": "x", "max_tokens": 2000, "temperature": 0, "logit_bias": {"128": 100}}
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].text == "\ufffd" * 2000 and whole.usage.completion_tokens == 2000
    events = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(events) == whole.choices[0].text
    assert len(events) > 100 and all(t and set(t) == {"\ufffd"} for t in events)
