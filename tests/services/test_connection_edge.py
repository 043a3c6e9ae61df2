"""Issue 65, gap A: connections that never finish their request headers, and more connections than descriptors.

* A connection whose request headers do not end within ``header_read_timeout_s`` (router and nodes, default
  10 s) gets 408 and is closed, on a fresh connection and on a kept-alive one alike (aiohttp alone holds it for
  ``keepalive_timeout_s``, 75 s).
* At the usual open-file limit of 1,024, connections over ``router.max_open_connections`` (half the limit) are
  answered 503 at once, while a connection already open is served and no node is taken out (unfixed, the router
  ran out of descriptors: its connects to the nodes failed with EMFILE and took them out).
"""

from __future__ import annotations

import http.client
import json
import resource
import selectors
import socket
import time

from kvrelay.transfer.config import TOKEN_HEADER

from tests.services.cluster import Cluster
from tests.services.test_slow_clients import _host_port, _read_all

PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"  # no blank line
# Generous against the 10 s default deadline on 2 shared cores; far below the 75 s keep-alive that closed them before.
CLOSED_WITHIN_S = 40
FD_LIMIT = 1024  # the usual soft and hard limit of a login shell / container without tuning
FLOOD = 1100  # more connections than the router's descriptors; over its default cap of FD_LIMIT // 2


def _partial(host: str, port: int) -> socket.socket:
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(PARTIAL_HEAD)
    return s


def test_a_connection_that_never_finishes_its_headers_gets_408_within_the_deadline(tiny_model_dir):
    with Cluster(tiny_model_dir) as c:
        targets = [_host_port(c.url), _host_port(c.decode_urls[0])]  # the router, and a node's server
        fresh = [_partial(*t) for t in targets]
        # A kept-alive connection whose next request's headers stop halfway: the deadline starts at its first byte.
        kept = socket.create_connection(targets[0], timeout=10)
        kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        first = kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first[:200]
        kept.sendall(PARTIAL_HEAD)
        t0 = time.monotonic()
        answers = [_read_all(s, CLOSED_WITHIN_S + 5) for s in (*fresh, kept)]  # until the server closes it
        took = time.monotonic() - t0
        for s in (*fresh, kept):
            s.close()
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 408 Request Timeout"] * 3, answers
    assert b"within 10 s (router.header_read_timeout_s)" in answers[0]
    assert b"within 10 s (internal.header_read_timeout_s)" in answers[1]
    assert took < CLOSED_WITHIN_S


def _first_answers(socks: list[socket.socket], wait_s: float) -> dict[int, bytes]:
    """What each of ``socks`` (by index) received within ``wait_s``; silent ones are left out."""
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    got: dict[int, bytes] = {}
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            try:
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except ConnectionResetError:
                data = b""
            got[key.data] = got.get(key.data, b"") + data
            if not data:
                sel.unregister(key.fileobj)
    sel.close()
    for s in socks:
        s.setblocking(True)
    return got


def _completion(conn: http.client.HTTPConnection) -> tuple[int, dict]:
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                                             "temperature": 0, "ignore_eos": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_connections_over_the_cap_get_a_fast_503_and_an_open_connection_is_served_with_nodes_up(tiny_model_dir):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 256:  # this client's own descriptors, not the servers'
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD + 512), hard))
    # The deployment runs at FD_LIMIT, soft and hard. Node connections idle out fast (half of 4 s), so the flood
    # comes while the router holds none and must connect to its nodes afresh (gap A's recipe, step 2).
    with Cluster(tiny_model_dir, nofile=(FD_LIMIT, FD_LIMIT), overrides={"internal": {"keepalive_timeout_s": 4}}) as c:
        host, port = _host_port(c.url)
        conn = http.client.HTTPConnection(host, port, timeout=120)  # opened before the flood: kept alive
        assert _completion(conn)[0] == 200
        time.sleep(5)
        socks = []
        try:
            for _ in range(FLOOD):
                socks.append(_partial(host, port))
            refused = _first_answers(socks, 5.0)  # over the cap: answered at once
            status, body = _completion(conn)  # needs fresh connections to both nodes
            assert (status, body.get("usage", {}).get("completion_tokens")) == (200, 4), body
            conn.request("GET", "/health", headers={TOKEN_HEADER: c.token})
            health = json.loads(conn.getresponse().read())
            assert {name: n["times_down"] for name, n in health["nodes"].items()} == {"prefill-0": 0, "decode-0": 0}
            heads = {a.split(b"\r\n", 1)[0] for a in refused.values()}
            assert heads == {b"HTTP/1.1 503 Service Unavailable"}, heads
            assert b"too many open connections (512, router.max_open_connections)" in next(iter(refused.values()))
            assert len(refused) >= FLOOD - FD_LIMIT // 2  # the cap counts the kept-alive connection too
            closed = [_read_all(s, CLOSED_WITHIN_S + 5) if i not in refused else b"" for i, s in enumerate(socks)]
        finally:
            for s in socks:
                s.close()
            conn.close()
    held = [a for i, a in enumerate(closed) if i not in refused]
    assert [a.split(b"\r\n", 1)[0] for a in held] == [b"HTTP/1.1 408 Request Timeout"] * len(held)
