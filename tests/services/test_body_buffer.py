"""The router bounds the request bodies it holds while reading them (issue 65 item 6, `router.body_buffer`): a
body that would pass ``router.max_buffered_body_bytes`` gets a 503 naming the key, and the rest are unaffected."""

from __future__ import annotations

import json
import socket

from tests.services.cluster import Cluster, get_json
from tests.services.test_aborts import settled
from tests.services.test_faults import post, wait_for


def test_bodies_past_the_routers_body_budget_get_503_naming_the_key_and_the_rest_are_served(tiny_model_dir):
    with Cluster(tiny_model_dir, overrides={"router": {"max_buffered_body_bytes": "64KiB"}}) as c:
        host, port = c.url.removeprefix("http://").split(":")
        # A client that announces 60,000 bytes and trickles: its body holds 60,000 of the 65,536 until it ends.
        slow = socket.create_connection((host, int(port)), timeout=30)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 60000\r\n\r\n{")
        ten_kib = {"model": "tiny", "prompt": [200] * 1800, "max_tokens": 2, "ignore_eos": True}  # 9,066 bytes
        wait_for(lambda: post(c.url, ten_kib)[0] == 503, what="the budget taken by the trickled body")
        code, body = post(c.url, ten_kib)
        assert code == 503
        assert body["error"]["message"].startswith("the router holds 60000 bytes of request bodies being read, and "
                                                   "this one would pass its 65536-byte limit "
                                                   "(router.max_buffered_body_bytes); retry later")
        small = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        code, body = post(c.url, small)  # fits beside it
        assert code == 200 and body["usage"]["completion_tokens"] == 2
        slow.close()  # its bytes are given back
        wait_for(lambda: post(c.url, ten_kib)[0] == 200, what="the budget back")
        assert get_json(c.url + "/health")["status"] == "ok"
        assert not any(settled(c).values())


def test_a_body_of_the_wrong_json_or_size_is_refused_naming_the_problem(tiny_model_dir):
    with Cluster(tiny_model_dir, overrides={"router": {"max_body_bytes": "64KiB"}}) as c:
        code, body = post(c.url, {"model": "tiny", "prompt": "x" * 70_000, "max_tokens": 2})
        assert code == 413
        assert body["error"]["message"] == "request body exceeds the 65536-byte limit (router.max_body_bytes)"
        host, port = c.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 5\r\n\r\n{nope")
            answer = s.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 400")
        assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]["message"].startswith(
            "request body is not valid JSON: Expecting property name enclosed in double quotes")
