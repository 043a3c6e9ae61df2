"""The disaggregated path: KV-aware routing over 2 prefill + 2 decode nodes, KV moved over NIXL."""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer

from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_faults import post, wait_for


def prefix_hits(url: str) -> float:
    return metrics(url).get("kvrelay_engine_prefix_hit_tokens_total", 0.0)


def prefill_requests(url: str) -> float:
    return metrics(url).get('kvrelay_requests_total{role="prefill",status="ok"}', 0.0)


def test_requests_sharing_a_prefix_go_to_the_prefill_that_holds_it(tiny_model_dir, tmp_path):
    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(160)] for _ in range(2)]  # 10 blocks each
    with Cluster(tiny_model_dir, prefill=2, decode=2) as c:
        first = [{"model": "tiny", "prompt": p + [1, 2, 3], "max_tokens": 2, "temperature": 0} for p in prefixes]
        with ThreadPoolExecutor(2) as pool:  # arrive together: the queue weighting splits them
            assert [code for code, _ in pool.map(lambda b: post(c.url, b), first)] == [200, 200]
        assert sorted(prefill_requests(u) for u in c.prefill_urls) == [1.0, 1.0]

        def indexed() -> bool:  # each prefill's KV events have reached the router's index
            nodes = get_json(c.url + "/health")["nodes"]
            return all(n["kv_keys"] >= 10 for name, n in nodes.items() if name.startswith("prefill"))

        wait_for(indexed, what="KV events indexed")
        owner = {}
        for i, p in enumerate(prefixes):
            before = {u: (prefill_requests(u), prefix_hits(u)) for u in c.prefill_urls}
            code, _ = post(c.url, {"model": "tiny", "prompt": p + [9, 9, 9, 9], "max_tokens": 2, "temperature": 0})
            assert code == 200
            after = {u: (prefill_requests(u), prefix_hits(u)) for u in c.prefill_urls}
            served = [u for u in c.prefill_urls if after[u][0] == before[u][0] + 1]
            assert len(served) == 1
            owner[i] = served[0]
            assert after[served[0]][1] - before[served[0]][1] == 160  # all 10 prefix blocks reused
        assert owner[0] != owner[1]


def transfer(url: str) -> tuple[float, float]:
    """KV bytes pulled and failed pulls (all reasons) so far."""
    m = metrics(url)
    failures = sum(v for k, v in m.items() if k.startswith("kvrelay_kv_transfer_failures_total{"))
    return m.get("kvrelay_kv_transfer_bytes_total", 0.0), failures


@pytest.fixture(scope="module")
def default_cluster(tiny_model_dir):
    """1P1D with the test defaults, shared by the tests that neither kill nor reconfigure it; each counts
    from the metrics it reads at its start (their prompts share no block)."""
    with Cluster(tiny_model_dir) as c:
        yield c


def failure_reasons(url: str) -> dict[str, float]:
    """Failed pulls by reason label, the reasons seen so far only."""
    prefix = 'kvrelay_kv_transfer_failures_total{reason="'
    return {k[len(prefix):-2]: v for k, v in metrics(url).items() if k.startswith(prefix)}


def test_kv_moves_once_then_the_prefix_is_reused(tiny_model_dir, default_cluster):

    loaded = load_model(tiny_model_dir)
    block_bytes = LLMEngine.block_spec_for(loaded, 16).block_bytes
    rng = random.Random(1)
    prompt = [rng.randrange(256) for _ in range(100)]  # 6 full blocks + a 4-token tail
    [[want]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], SamplingParams(max_tokens=12))
    c = default_cluster
    decode, prefill = c.decode_urls[0], c.prefill_urls[0]
    bytes0, failures0 = transfer(decode)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    code, out = post(c.url, body)
    assert code == 200
    bytes1, failures = transfer(decode)
    assert bytes1 - bytes0 == 6 * block_bytes and failures == failures0
    hits_before = prefix_hits(prefill)
    code, out2 = post(c.url, body)
    assert code == 200 and out2["choices"][0]["text"] == out["choices"][0]["text"]
    assert prefix_hits(prefill) - hits_before == 6 * 16  # prefill reused its cached blocks
    assert transfer(decode) == (bytes1, failures0)  # decode already held them: nothing moved
    longer = prompt + [rng.randrange(256) for _ in range(40)]  # 2 more full blocks + a tail
    assert post(c.url, {**body, "prompt": longer})[0] == 200
    assert transfer(decode) == (bytes1 + 2 * block_bytes, failures0)  # only the new full blocks
    wait_for(lambda: all(get_json(u + "/health")["in_use_blocks"] == 0 for u in (decode, prefill)),
             what="leases released and pools idle")
    assert out["choices"][0]["text"] == load_tokenizer(tiny_model_dir).decode(want)


def _internal_post(url: str, path: str, body: dict, token: str = "kvrelay-test-token") -> tuple[int, list[dict]]:
    """POST msgpack to a node (with the `Cluster`'s internal token); the answer's msgpack objects (one,
    or a decode stream's frames)."""
    import urllib.error
    import urllib.request

    from kvrelay.transfer.config import TOKEN_HEADER
    from kvrelay.transfer.wire import new_unpacker, pack

    req = urllib.request.Request(url + path, data=pack(body), method="POST",
                                 headers={"Content-Type": "application/msgpack", TOKEN_HEADER: token})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, data = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, data = err.code, err.read()
    unpacker = new_unpacker()
    unpacker.feed(data)
    return status, list(unpacker)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_after_handing_out_kv(tiny_model_dir, tmp_path, policy):
    from kvrelay.transfer.wire import params_to_wire

    loaded = load_model(tiny_model_dir)
    rng = random.Random(2)
    prompt = [rng.randrange(256) for _ in range(70)]
    [[want]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], SamplingParams(max_tokens=10))
    params = params_to_wire(SamplingParams(max_tokens=10))
    with Cluster(tiny_model_dir, overrides={"decode": {"on_transfer_failure": policy}}) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        status, [pre] = _internal_post(prefill, "/prefill", {"request_id": "r1", "prompt": prompt,
                                                             "params": params, "salt": b""})
        assert status == 200 and pre["first_token_ids"] == want[:1] and pre["handle"] is not None
        os.kill(c.node_pid(prefill), signal.SIGKILL)
        status, frames = _internal_post(decode, "/generate", {
            "request_id": "r1", "prompt": prompt, "params": params, "salt": b"",
            "first_token_ids": pre["first_token_ids"], "handle": pre["handle"]})
        if policy == "recompute":
            assert status == 200
            assert want[:1] + [t for f in frames for t in f["tokens"]] == want
        else:
            assert status == 502 and "KV transfer from the prefill node failed (handshake)" in frames[0]["error"]
        assert transfer(decode)[1] == 1.0
        assert failure_reasons(decode) == {"handshake": 1.0}  # the owner died before decode ever reached it
        wait_for(lambda: get_json(decode + "/health")["in_use_blocks"] == 0, what="decode pool idle")


def test_a_malformed_handle_is_counted_as_bad_handle_and_recomputed(tiny_model_dir):
    from kvrelay.transfer.wire import params_to_wire

    loaded = load_model(tiny_model_dir)
    prompt = list(range(3, 40))
    [[want]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], SamplingParams(max_tokens=6))
    with Cluster(tiny_model_dir, overrides={"prefill": {"ports": []}}) as c:  # decode alone; default: recompute
        decode = c.decode_urls[0]
        status, frames = _internal_post(decode, "/generate", {
            "request_id": "r1", "prompt": prompt, "params": params_to_wire(SamplingParams(max_tokens=6)),
            "salt": b"", "handle": {"v": 999}})
        assert status == 200 and [t for f in frames for t in f["tokens"]] == want  # recomputed here, right answer
        assert failure_reasons(decode) == {"bad_handle": 1.0}
        wait_for(lambda: get_json(decode + "/health")["in_use_blocks"] == 0, what="decode pool idle")


def test_forged_handles_are_refused_and_nothing_is_stored(tiny_model_dir, default_cluster):
    """Issue 13, test 3: a handle whose keys are not the request's own prompt and salt (another prompt,
    another tenant's salt) or whose owner is not a prefill node of this deployment is refused before
    any contact; the request is recomputed with the right tokens, and later requests too."""
    from kvrelay.transfer.wire import params_to_wire

    loaded = load_model(tiny_model_dir)
    rng = random.Random(5)
    a = [rng.randrange(256) for _ in range(70)]
    b = [rng.randrange(256) for _ in range(70)]
    [[want_b]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([b], SamplingParams(max_tokens=6))
    params = params_to_wire(SamplingParams(max_tokens=6))
    c = default_cluster
    prefill, decode = c.prefill_urls[0], c.decode_urls[0]
    reasons0, bytes0 = failure_reasons(decode), transfer(decode)[0]
    status, [pre] = _internal_post(prefill, "/prefill", {"request_id": "a", "prompt": a, "params": params,
                                                         "salt": b""})
    assert status == 200 and pre["handle"] is not None
    forged = {
        "other prompt": dict(prompt=b, salt=b"", handle=pre["handle"]),
        "other tenant": dict(prompt=a, salt=b"t" * 16, handle=pre["handle"]),
        "foreign owner": dict(prompt=a, salt=b"", handle={**pre["handle"], "owner_url": "http://10.9.9.9:1"}),
    }
    for i, (name, fields) in enumerate(forged.items()):
        status, frames = _internal_post(decode, "/generate", {"request_id": f"f{i}", "params": params,
                                                              "first_token_ids": pre["first_token_ids"], **fields})
        assert status == 200, (name, frames)
    reasons = failure_reasons(decode)
    assert {k: v - reasons0.get(k, 0.0) for k, v in reasons.items() if v != reasons0.get(k, 0.0)} == {
        "key_mismatch": 2.0, "foreign_owner": 1.0}
    assert transfer(decode)[0] == bytes0  # not a byte was read from anyone
    wait_for(lambda: get_json(decode + "/health")["in_use_blocks"] == 0, what="decode pool idle")
    code, body = post(c.url, {"model": "tiny", "prompt": b, "max_tokens": 6, "temperature": 0})
    assert code == 200 and body["usage"]["completion_tokens"] == len(want_b)
    assert body["choices"][0]["text"] == load_tokenizer(tiny_model_dir).decode(want_b)


def test_decode_accepts_the_prefill_node_by_the_url_the_router_reaches_it_at(tiny_model_dir):
    """Issue 13: the name a prefill node gives itself (on k8s its FQDN; here 127.0.0.1) may differ from
    the router's URL for it (a Service name; here ``localhost``). The router writes the URL it reached
    the node at into the handle, so the decode node, which trusts exactly the router's prefill URLs,
    pulls the KV instead of refusing it as foreign; the node's own name is still refused."""
    from kvrelay.benchmarks.deployment import free_ports
    from kvrelay.transfer.wire import params_to_wire

    loaded = load_model(tiny_model_dir)
    prompt = list(range(5, 75))
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    [[want]] = engine.generate([prompt], SamplingParams(max_tokens=6))
    [port] = free_ports(1)
    with Cluster(tiny_model_dir, overrides={"prefill": {"ports": [port]},
                                            "router": {"prefill_urls": [f"http://localhost:{port}"]}}) as c:
        assert c.prefill_urls == [f"http://localhost:{port}"]
        decode = c.decode_urls[0]
        code, body = post(c.url, {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert code == 200 and body["usage"]["completion_tokens"] == len(want)
        assert body["choices"][0]["text"] == load_tokenizer(tiny_model_dir).decode(want)
        assert transfer(decode) == (4 * engine.spec.block_bytes, 0.0)  # the prompt's 4 full blocks, pulled

        params = params_to_wire(SamplingParams(max_tokens=6))
        status, [pre] = _internal_post(c.prefill_urls[0], "/prefill", {"request_id": "own-name", "prompt": prompt,
                                                                       "params": params, "salt": b""})
        assert status == 200 and pre["handle"]["owner_url"] == f"http://127.0.0.1:{port}"
        status, frames = _internal_post(decode, "/generate", {
            "request_id": "own-name", "prompt": prompt, "params": params, "salt": b"",
            "first_token_ids": pre["first_token_ids"], "handle": pre["handle"]})
        assert status == 200 and pre["first_token_ids"] + [t for f in frames for t in f["tokens"]] == want
        assert failure_reasons(decode) == {"foreign_owner": 1.0}
