"""Issue 28: no lease outlives its request. Every refusal of a KV handle — by the decode node (a handle
naming blocks its owner lacks, keys of another prompt, a foreign owner), by the router (a handle that does
not parse), by a draining decode node — leaves the prefill node with no lease within a second, although
the leases here would live 60 s. The decode node's answer says who ends the lease (LEASE_HEADER)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.transfer.config import LEASE_HEADER, TOKEN_HEADER

from tests.services.cluster import Cluster, get_json, publish_faults
from tests.services.test_disagg import failure_reasons
from tests.services.test_faults import post, wait_for

PROMPT = list(range(7, 77))  # 4 full blocks and a tail
LONG_LEASES = {"prefill": {"lease_ttl_s": 60}}  # a lease gone within 1 s was released, not reaped


def leases(prefill: str) -> int:
    return get_json(prefill + "/health")["leases"]


def reference(model_dir, prompt: list[int], max_tokens: int) -> str:
    [[ids]] = LLMEngine(load_model(model_dir), EngineConfig(num_blocks=64)).generate(
        [prompt], SamplingParams(max_tokens=max_tokens))
    return load_tokenizer(model_dir).decode(ids)


@pytest.mark.parametrize(("fault", "decode_failures"), [
    ("handle_names_absent_blocks", {"bad_handle": 1.0}),  # refused by the puller after contact: it aborts
    ("handle_with_other_keys", {"key_mismatch": 1.0}),  # refused before contact: the router releases
    ("malformed_handle", {}),  # does not parse at the router: it releases by the lease id, decode recomputes
])
def test_a_refused_handle_leaves_no_lease_behind(tiny_model_dir, fault, decode_failures):
    want = reference(tiny_model_dir, PROMPT, 6)
    overrides = {"prefill": {"lease_ttl_s": 60}}
    with Cluster(tiny_model_dir, overrides=overrides, env=publish_faults(fault)) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        code, body = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert code == 200 and body["choices"][0]["text"] == want  # recomputed on the decode node
        wait_for(lambda: leases(prefill) == 0, 1.0, f"the lease of a {fault} handle to end")
        assert failure_reasons(decode) == decode_failures
        wait_for(lambda: get_json(decode + "/health")["in_use_blocks"] == 0, 5.0, "the decode pool to be idle")


def _generate(url: str, body: dict, token: str) -> tuple[int, dict[str, str]]:
    from kvrelay.transfer.wire import pack

    req = urllib.request.Request(url + "/generate", data=pack(body), method="POST",
                                 headers={"Content-Type": "application/msgpack", TOKEN_HEADER: token})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
        return resp.status, dict(resp.headers)


def test_the_decode_node_says_whether_it_ended_the_lease(tiny_model_dir):
    """A pulled handle: "ended" (the puller sent "done"). A foreign owner: "open", and the lease untouched
    (the node never contacts an owner it does not trust): the router releases it, as for key_mismatch."""
    from kvrelay.transfer.wire import params_to_wire

    from tests.services.test_disagg import _internal_post

    params = params_to_wire(SamplingParams(max_tokens=3))
    with Cluster(tiny_model_dir, overrides=LONG_LEASES) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        handles = []
        for rid in ("a", "b"):
            status, [pre] = _internal_post(prefill, "/prefill", {"request_id": rid, "prompt": PROMPT,
                                                                 "params": params, "salt": b""})
            assert status == 200 and pre["handle"] is not None
            handles.append(pre)
        assert leases(prefill) == 2
        a, b = handles
        status, headers = _generate(decode, {"request_id": "a", "prompt": PROMPT, "params": params, "salt": b"",
                                             "first_token_ids": a["first_token_ids"], "handle": a["handle"]}, c.token)
        assert (status, headers[LEASE_HEADER]) == (200, "ended")
        wait_for(lambda: leases(prefill) == 1, 1.0, "the done notification to end lease a")
        foreign = {**b["handle"], "owner_url": "http://10.9.9.9:1"}
        status, headers = _generate(decode, {"request_id": "b", "prompt": PROMPT, "params": params, "salt": b"",
                                             "first_token_ids": b["first_token_ids"], "handle": foreign}, c.token)
        assert (status, headers[LEASE_HEADER]) == (200, "open")
        assert failure_reasons(decode) == {"foreign_owner": 1.0}
        assert leases(prefill) == 1  # the decode node did not touch it
        # what the router does with an open lease
        from kvrelay.transfer.wire import decode_release_reply, encode_lease_request

        req = urllib.request.Request(prefill + "/kv/lease/release", data=encode_lease_request(b["handle"]["lease_id"]),
                                     method="POST", headers={TOKEN_HEADER: c.token})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert decode_release_reply(resp.read()) is True
        assert leases(prefill) == 0


def test_a_draining_decode_node_s_refusal_releases_the_lease(tiny_model_dir):
    with Cluster(tiny_model_dir, overrides={**LONG_LEASES, "internal": {"drain_timeout_s": 30}}) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        body = json.dumps({"model": "tiny", "prompt": "keep me busy", "max_tokens": 1900, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        done = threading.Event()

        def long_stream() -> None:
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
            done.set()

        thread = threading.Thread(target=long_stream)
        thread.start()
        wait_for(lambda: get_json(decode + "/health")["running"] == 1, what="the long request decoding")
        os.kill(c.node_pid(decode), signal.SIGTERM)  # it drains: the running stream may finish, new ones 503
        wait_for(lambda: any("decode-0 stopping" in line for line in c.log), what="the drain to begin")
        code, answer = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        t0 = time.monotonic()
        assert code == 503 and "no decode node is available" in answer["error"]["message"], answer
        assert not done.is_set()  # still draining: the refusal came from the draining node
        wait_for(lambda: leases(prefill) == 0, 1.0, "the router to release the refused handle's lease")
        assert time.monotonic() - t0 < 1.5
        thread.join(timeout=120)
        assert done.is_set()
