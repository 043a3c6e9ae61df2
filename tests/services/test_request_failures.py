"""Issue 65: one request's failure is that request's error, in real node processes (faults from
`tests/services/hang_site`, a test-side sitecustomize; the product has no such knob):

* a request that fails every engine step it is in (a poison request) on a decode node running 20 other streams
  fails alone with a 500 naming the internal error; the other 20 finish with the token ids of an undisturbed
  run; the node is never taken out and nothing moves;
* a request whose prefill node answers 500 is that request's error: it is not sent to the other prefill node, nor
  to the decode node;
* a stream the decode node cuts off because the router stopped reading it (its client did) ends with its own
  error; the node is not taken out and the request does not move.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from kvrelay.model.sampling import SamplingParams

from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_engine_stall import _arm, _hang_env
from tests.services.test_faults import post, wait_for
from tests.services.test_migration import Stream, idle, reference

POISON = [250, 251, 252, 253]  # a prompt that starts so fails each step of a node armed with `_poison`
STREAMS = 20
MAX_TOKENS = 300


def _poison(hang_dir: Path, node: str, *, after_tokens: int) -> None:
    _arm(hang_dir / f"{node}.poison", json.dumps({"prefix": POISON, "after_tokens": after_tokens}))


def _token_ids(body: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def _node_requests(url: str, role: str) -> float:
    """Requests a node has answered, whatever their status."""
    return sum(v for k, v in metrics(url).items() if k.startswith(f'kvrelay_requests_total{{role="{role}"'))


def _migrations(url: str) -> dict[str, float]:
    return {k: v for k, v in metrics(url).items() if k.startswith("kvrelay_router_migrations_total")}


def test_a_poison_request_among_20_streams_fails_alone_and_the_node_stays_in(tiny_model_dir, tmp_path):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 30))] for _ in range(STREAMS)]
    bodies = [{"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0} if i % 2 == 0 else
              {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "seed": 500 + i}
              for i in range(STREAMS)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=b["temperature"],
                             top_p=b.get("top_p", 1.0), seed=b.get("seed")) for b in bodies]
    expected = reference(tiny_model_dir, prompts, params)
    _poison(tmp_path, "decode-0", after_tokens=3)  # its first token comes from the prefill node, unarmed
    with Cluster(tiny_model_dir, prefill=1, decode=1, env=_hang_env(tmp_path)) as c:
        [decode] = c.decode_urls
        pid = c.node_pid(decode)
        with ThreadPoolExecutor(STREAMS + 1) as pool:
            futures = [pool.submit(post, c.url, {"model": "tiny", "prompt": p, "logprobs": 0,
                                                 "return_tokens_as_token_ids": True, **b}, 300.0)
                       for p, b in zip(prompts, bodies, strict=True)]
            wait_for(lambda: get_json(decode + "/health")["running"] == STREAMS, timeout_s=120,
                     what=f"{STREAMS} streams running on the decode node")
            bad = post(c.url, {"model": "tiny", "prompt": POISON + [9] * 8, "max_tokens": 40, "temperature": 0},
                       120.0)
            results = [f.result(timeout=600) for f in futures]
        code, body = bad
        assert code == 500, body
        assert ("internal error: the engine step failed on this request (IndexError: index 4242 is out of bounds"
                in body["error"]["message"]), body
        assert [code for code, _ in results] == [200] * STREAMS
        for i, (_, answer) in enumerate(results):
            assert _token_ids(answer) == expected[i], f"stream {i} differs from an undisturbed run"
        health = get_json(c.url + "/health")["nodes"]
        assert health["decode-0"]["times_down"] == 0 and health["prefill-0"]["times_down"] == 0
        assert _migrations(c.url) == {}
        assert c.node_pid(decode) == pid
        wait_for(lambda: idle([*c.prefill_urls, decode]), what="every block given back")


def test_a_request_its_prefill_node_fails_with_500_is_not_sent_to_another_node(tiny_model_dir, tmp_path):
    for node in ("prefill-0", "prefill-1"):
        _poison(tmp_path, node, after_tokens=0)
    with Cluster(tiny_model_dir, prefill=2, decode=1, env=_hang_env(tmp_path)) as c:
        code, body = post(c.url, {"model": "tiny", "prompt": POISON + [9] * 8, "max_tokens": 8, "temperature": 0})
        assert code == 500, body
        assert "internal error: the engine step failed on this request (IndexError" in body["error"]["message"]
        assert sorted(_node_requests(u, "prefill") for u in c.prefill_urls) == [0, 1]
        assert _node_requests(c.decode_urls[0], "decode") == 0
        health = get_json(c.url + "/health")["nodes"]
        assert [health[n]["times_down"] for n in ("prefill-0", "prefill-1", "decode-0")] == [0, 0, 0]
        # the node serves on
        code, body = post(c.url, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert code == 200 and body["usage"]["completion_tokens"] == 4


def test_a_stream_the_decode_node_cuts_off_for_a_stalled_reader_ends_alone(tiny_model_dir, tmp_path):
    """gap C of the 2026-12-07 edges notes: the decode node cuts off a router that stopped reading a stream (here
    its 50th write fails as such a write does, `hang_site`); the router finds the node up."""
    _arm(tmp_path / "decode-0.cut-after-writes", "50")
    with Cluster(tiny_model_dir, prefill=1, decode=1, env=_hang_env(tmp_path)) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = Stream(client, [5, 6, 7], {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}})
        stream()
        assert (tmp_path / "decode-0.cut").exists()
        assert stream.finish is None and stream.pieces
        assert isinstance(stream.error, openai.APIError)
        assert str(stream.error).startswith("decode-0 broke off this request's stream (decode-0: stream from "
                                            "/generate failed: ClientPayloadError"), stream.error
        assert str(stream.error).endswith("and is up; the request is not moved to another node")
        assert any("did not read the stream for 60 s (decode.write_stall_timeout_s); dropped and aborted" in line
                   for line in c.log)
        assert get_json(c.url + "/health")["nodes"]["decode-0"]["times_down"] == 0
        assert _migrations(c.url) == {}
        code, answer = post(c.url, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert code == 200 and answer["usage"]["completion_tokens"] == 4
        assert metrics(c.decode_urls[0])['kvrelay_requests_total{role="decode",status="reader_stalled"}'] == 1
        wait_for(lambda: idle([*c.prefill_urls, *c.decode_urls]), what="every block given back")
