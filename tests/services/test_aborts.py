"""A client that leaves frees what its request holds on every node at once, whatever stage the request is in
(issue 65, item 7), and the router counts the abort under that stage (``kvrelay_router_aborts_total{stage}``).

Each stage is made long with a test-side hook (`tests/services/hang_site`), so that the client leaves inside it
every time; the prefill node's lease TTL is 120 s, so a lease that expired cannot pass for one released. The
decode stage (a client that leaves mid-stream) is `tests/services/test_faults.py`'s disconnect test.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_engine_stall import HANG_SITE, _arm
from tests.services.test_faults import post, wait_for

LEASE_TTL_S = 120  # far beyond every wait below: only a release frees a lease in time
SETTLE_S = 40.0  # how long the nodes get to free everything after the client left (≪ LEASE_TTL_S)
PROMPT = list(range(5, 5 + 70))  # 4 full blocks of 16 tokens: a KV handle with something to pull


def _cluster(model: Path, hang_dir: Path, **overrides: dict) -> Cluster:
    return Cluster(model, overrides={"prefill": {"lease_ttl_s": LEASE_TTL_S}, **overrides},
                   env={"PYTHONPATH": HANG_SITE, "KVRELAY_TEST_HANG_DIR": str(hang_dir)})


def _open_stream(url: str, body: dict) -> socket.socket:
    """A streamed completion sent on a raw socket (closing it is the client leaving)."""
    data = json.dumps({**body, "stream": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def aborts(c: Cluster) -> dict[str, float]:
    m = metrics(c.url)
    return {stage: m[f'kvrelay_router_aborts_total{{stage="{stage}"}}'] for stage in
            ("queued", "prefill", "pull", "decode")}


def held(c: Cluster) -> dict[str, int]:
    """What the nodes still hold for requests: blocks in use per node, and the prefill nodes' open leases."""
    out = {url: get_json(url + "/health")["in_use_blocks"] for url in c.prefill_urls + c.decode_urls}
    out.update({url + " leases": get_json(url + "/health")["leases"] for url in c.prefill_urls})
    return out


def settled(c: Cluster) -> dict[str, int]:
    """`held`, once nothing is held or after SETTLE_S."""
    try:
        wait_for(lambda: not any(held(c).values()), timeout_s=SETTLE_S, what="every block and lease freed")
    except AssertionError:
        pass
    return held(c)


def test_a_client_that_leaves_while_its_prompt_is_prefilled_frees_the_prefill_nodes_blocks_and_lease(
        tiny_model_dir, tmp_path):
    with _cluster(tiny_model_dir, tmp_path) as c:
        _arm(tmp_path / "prefill-0.hang", "4")  # the prompt's step: 4 s on the prefill node's engine thread
        s = _open_stream(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True})
        wait_for(lambda: (tmp_path / "prefill-0.hanging").exists(), what="the prompt's step begun")
        s.close()
        wait_for(lambda: aborts(c)["prefill"] == 1, what="the abort counted")
        assert settled(c) == {u: 0 for u in held(c)}
        assert aborts(c) == {"queued": 0, "prefill": 1, "pull": 0, "decode": 0}
        # The prefill node finished the prompt (its step was under way) and its answer went nowhere: the
        # decode node never saw the request.
        assert 'kvrelay_requests_total{role="decode",status="ok"}' not in metrics(c.decode_urls[0])
        assert get_json(c.url + "/health")["status"] == "ok"
        code, body = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert code == 200 and body["usage"]["completion_tokens"] == 3


def test_a_client_that_leaves_while_its_kv_is_pulled_frees_blocks_and_lease_on_both_nodes(tiny_model_dir, tmp_path):
    with _cluster(tiny_model_dir, tmp_path) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        _arm(tmp_path / "decode-0.pull-delay", "10")  # its READs issued, the pull waits 10 s more
        s = _open_stream(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True})
        wait_for(lambda: (tmp_path / "decode-0.pull-delaying").exists(), what="the pull in flight")
        assert get_json(prefill + "/health")["leases"] == 1
        assert get_json(decode + "/health")["in_use_blocks"] == 4  # reserved for the pull
        s.close()
        wait_for(lambda: aborts(c)["pull"] == 1, what="the abort counted")
        # The router released the lease as the client left (the pull still waits on the decode node).
        wait_for(lambda: get_json(prefill + "/health")["leases"] == 0, timeout_s=8, what="the lease released")
        assert settled(c) == {u: 0 for u in held(c)}
        assert aborts(c) == {"queued": 0, "prefill": 0, "pull": 1, "decode": 0}
        code, body = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert code == 200 and body["usage"]["completion_tokens"] == 3
        assert settled(c) == {u: 0 for u in held(c)}


def test_a_client_that_leaves_while_queued_for_a_full_decode_node_holds_nothing_anywhere(tiny_model_dir, tmp_path):
    with _cluster(tiny_model_dir, tmp_path, decode={"max_pending_requests": 1}) as c:
        decode = c.decode_urls[0]
        _arm(tmp_path / "decode-0.step-delay", "0.05")  # 200 tokens: ≥ 10 s on the decode node
        busy = {"model": "tiny", "prompt": "hold the only slot", "max_tokens": 200, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, c.url, busy, 120)
            wait_for(lambda: get_json(decode + "/health")["running"] == 1, what="the slot taken")
            s = _open_stream(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 5})
            wait_for(lambda: metrics(c.url)["kvrelay_router_queued_requests"] == 1, what="the second queued")
            s.close()
            wait_for(lambda: aborts(c)["queued"] == 1, what="the abort counted")
            assert metrics(c.url)["kvrelay_router_queued_requests"] == 0
            assert get_json(decode + "/health")["running"] == 1  # the first still runs
            code, body = first.result(timeout=120)
        assert code == 200 and body["usage"]["completion_tokens"] == 200
        (tmp_path / "decode-0.step-delay").unlink()
        assert settled(c) == {u: 0 for u in held(c)}
        assert aborts(c) == {"queued": 1, "prefill": 0, "pull": 0, "decode": 0}
        # Only the first reached the nodes.
        assert metrics(decode)['kvrelay_requests_total{role="decode",status="ok"}'] == 1
        assert metrics(c.prefill_urls[0])['kvrelay_requests_total{role="prefill",status="ok"}'] == 1
