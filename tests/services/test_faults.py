"""Failures through `kvrelay up`: dead decode node, client disconnects, overload, internal token."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvrelay.transfer.config import TOKEN_HEADER

from tests.services.cluster import Cluster, get_json, metrics


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.1)


def pools_idle(cluster: Cluster) -> bool:
    return all(get_json(u + "/health")["in_use_blocks"] == 0 for u in cluster.prefill_urls + cluster.decode_urls)


def test_decode_killed_moves_in_flight_requests_and_new_requests_use_the_other(tiny_model_dir, tmp_path):
    """Issue 30: the requests of a decode node that dies move to the other (tests/services/test_migration.py
    checks their tokens); a non-streamed answer is whole."""
    with Cluster(tiny_model_dir, prefill=1, decode=2) as c:
        long = {"model": "tiny", "prompt": "abc", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, c.url, long) for _ in range(2)]
            wait_for(lambda: sum(get_json(u + "/health")["running"] for u in c.decode_urls) == 2, what="2 running")
            victim = next(u for u in c.decode_urls if get_json(u + "/health")["running"] > 0)
            os.kill(c.node_pid(victim), signal.SIGKILL)
            results = [f.result() for f in futures]
        assert [code for code, _ in results] == [200, 200]
        assert [body["usage"]["completion_tokens"] for _, body in results] == [1500, 1500]
        assert results[0][1]["choices"][0]["text"] == results[1][1]["choices"][0]["text"]  # same greedy request
        assert metrics(c.url)['kvrelay_router_migrations_total{outcome="moved"}'] >= 1
        survivor = next(u for u in c.decode_urls if u != victim)
        before = get_json(survivor + "/health")
        for _ in range(3):
            code, body = post(c.url, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0})
            assert code == 200 and body["usage"]["completion_tokens"] == 4
        assert get_json(survivor + "/health")["pid"] == before["pid"]
        assert metrics(survivor)['kvrelay_requests_total{role="decode",status="ok"}'] >= 3
        wait_for(lambda: get_json(survivor + "/health")["in_use_blocks"] == 0, what="survivor idle")


def _stream_and_hang_up(url: str, n_bytes: int) -> None:
    body = json.dumps({"model": "tiny", "prompt": "disconnect me", "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while len(got) < n_bytes:
            got += s.recv(4096)
        assert b"data: " in got


def test_client_disconnect_and_overload_leave_pools_at_baseline(tiny_model_dir, tmp_path):
    """A client that leaves mid-stream ends its request on the decode node: each decode step takes ≥ 50 ms here
    (hang_site's step delay), so its 1,500 tokens would take ≥ 75 s, and only the abort frees the pools within
    the 30 s wait (issue 65: before, the stream finished by itself inside the wait). The router counts the abort
    (``kvrelay_router_aborts_total{stage="decode"}``); `tests/services/test_aborts.py` has the other stages."""
    from tests.services.test_aborts import aborts
    from tests.services.test_engine_stall import HANG_SITE, _arm

    with Cluster(tiny_model_dir, overrides={"decode": {"max_pending_requests": 8}},
                 env={"PYTHONPATH": HANG_SITE, "KVRELAY_TEST_HANG_DIR": str(tmp_path)}) as c:
        delay = tmp_path / "decode-0.step-delay"
        _arm(delay, "0.05")
        _stream_and_hang_up(c.url, 2000)
        wait_for(lambda: pools_idle(c) and get_json(c.decode_urls[0] + "/health")["running"] == 0,
                 what="pools back to baseline after disconnect")
        assert aborts(c) == {"queued": 0, "prefill": 0, "pull": 0, "decode": 1}
        assert 'kvrelay_requests_total{role="decode",status="ok"}' not in metrics(c.decode_urls[0])
        delay.unlink()
        body = {"model": "tiny", "prompt": "load", "max_tokens": 8, "temperature": 0}
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda _: post(c.url, body, timeout=120), range(200)))
        codes = [code for code, _ in results]
        assert set(codes) <= {200, 429} and codes.count(200) >= 8
        for code, b in results:
            if code == 429:
                assert "capacity" in b["error"]["message"]
            else:
                assert b["usage"]["completion_tokens"] == 8
        wait_for(lambda: pools_idle(c), what="pools back to baseline after load")
        assert get_json(c.url + "/health")["status"] == "ok"


def test_internal_endpoints_need_the_token_and_bind_loopback(tiny_model_dir, tmp_path):
    with Cluster(tiny_model_dir, overrides={"internal": {"token_env": "KVRELAY_TEST_TOKEN"}},
                 env={"KVRELAY_TEST_TOKEN": "s3cret"}) as c:
        for url in c.prefill_urls + c.decode_urls:
            for path in ("/kv/events", "/info"):
                with pytest.raises(urllib.error.HTTPError) as err:
                    get_json(url + path)
                assert err.value.code == 401
            assert get_json(url + "/health")["status"] == "ok"
        code, body = post(c.url, {"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert code == 200 and body["usage"]["completion_tokens"] == 3
        for url in c.prefill_urls + c.decode_urls:
            port = url.rsplit(":", 1)[1]
            rows = [line.split() for line in os.popen(f"ss -ltnH 'sport = :{port}'").read().splitlines()]
            assert [r[3] for r in rows] == [f"127.0.0.1:{port}"]  # the local address: loopback only
            # Every socket the node listens on (its HTTP port and NIXL's UCX listeners) is on loopback.
            # this cluster's token is not the tests' usual one: /health answers in full only with it
            pid = int(get_json(url + "/health", headers={TOKEN_HEADER: "s3cret"})["pid"])
            mine = [line.split()[3] for line in os.popen("ss -ltnpH").read().splitlines() if f"pid={pid}," in line]
            assert len(mine) >= 2 and all(a.startswith("127.0.0.1:") for a in mine), mine


def test_the_internal_plane_fails_closed(tiny_model_dir, tmp_path):
    """Issue 13: a node reachable from other machines without a token refuses to start, naming the
    setting; `kvrelay up` with no token configured makes one up, so its nodes still refuse strangers."""
    import subprocess
    import sys

    cfg = tmp_path / "open.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_dir}}}\nkvstore: {{device: {{bytes: 8MiB}}}}\n"
                   "internal: {bind: 0.0.0.0}\nprefill: {ports: [0]}\n")
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_INTERNAL_TOKEN"}
    for role in ("prefill", "decode"):
        done = subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", role, "--config", str(cfg)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"kvrelay {role}: refusing to start: internal.bind is '0.0.0.0' (reachable from other machines) " \
               "but no internal token is set" in done.stderr
    with Cluster(tiny_model_dir, env={"KVRELAY_INTERNAL_TOKEN": ""}) as c:  # none configured: up makes one
        for url in c.prefill_urls + c.decode_urls:
            with pytest.raises(urllib.error.HTTPError) as err:
                get_json(url + "/info")
            assert err.value.code == 401
        code, body = post(c.url, {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert code == 200 and body["usage"]["completion_tokens"] == 3


def wait_restarted(c: Cluster, url: str, name: str, old_pid: int) -> None:
    """Until ``kvrelay up`` has restarted node ``name`` (a new pid at ``url``) and the router has it back."""
    def restarted() -> bool:
        try:
            return c.node_pid(url) != old_pid and get_json(c.url + "/health")["nodes"][name]["healthy"]
        except (OSError, KeyError):
            return False

    wait_for(restarted, timeout_s=120, what=f"{name} restarted")


def _status(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_sigterm_drains_in_flight_requests_and_persists_kv_for_the_restart(tiny_model_dir, tmp_path):
    """Issue 13, test 4: SIGTERM mid-stream lets the request finish (drain), writes the node's device
    and host blocks to disk, and the restarted node (``kvrelay up`` restarts it) finds the prompt on disk."""
    prompt = "a prompt long enough to fill several KV blocks of sixteen tokens each, twice over at least."
    long = {"model": "tiny", "prompt": prompt, "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    with Cluster(tiny_model_dir, overrides={"prefill": {"ports": []}, "internal": {"drain_timeout_s": 60}}) as c:
        decode = c.decode_urls[0]
        old_pid = c.node_pid(decode)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(post, c.url, long)
            wait_for(lambda: get_json(decode + "/health")["running"] == 1, what="the request running")
            os.kill(old_pid, signal.SIGTERM)
            # Draining: not ready (probes and load balancers stop sending), still alive.
            wait_for(lambda: _status(decode + "/ready") == (503, {"ready": False, "why": "draining"}),
                     what="the node not ready while it drains")
            assert _status(decode + "/health")[0] == 200
            code, body = running.result(timeout=120)
        assert code == 200 and body["usage"]["completion_tokens"] == 600  # drained: finished, not cut off

        wait_restarted(c, decode, "decode-0", old_pid)
        assert "KV blocks written to disk before stopping" in "".join(c.log)
        before = metrics(decode).get("kvrelay_engine_prefix_hit_tokens_total", 0.0)
        code, body = post(c.url, {**long, "max_tokens": 4})
        assert code == 200
        # A fresh process: every prefix hit comes from the disk tier the drain wrote.
        assert metrics(decode)["kvrelay_engine_prefix_hit_tokens_total"] - before >= 16


def test_a_drain_that_runs_out_of_time_cuts_streams_off_with_an_error_and_releases_leases(tiny_model_dir):
    """Issue 13, test 4, the other half: what is still running when ``drain_timeout_s`` is up ends with
    an error event and ``[DONE]`` (not a broken connection), and a stopping prefill node releases the
    leases nobody read before it writes its blocks to disk."""
    from kvrelay.model.sampling_params import SamplingParams
    from kvrelay.transfer.config import TOKEN_HEADER
    from kvrelay.transfer.wire import GenerationMessage, decode_prefill_reply, encode_generation

    # A short drain: the 2,000-token stream cannot finish within it (a decode step here takes ~1-2 ms).
    with Cluster(tiny_model_dir, overrides={"internal": {"drain_timeout_s": 0.2}}) as c:
        decode, prefill = c.decode_urls[0], c.prefill_urls[0]
        body = json.dumps({"model": "tiny", "prompt": "cut me off", "max_tokens": 2000, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            first = resp.readline()
            assert first.startswith(b"data: {")  # the prefill node's first token; now the decode node's part:
            wait_for(lambda: get_json(decode + "/health")["running"] == 1, what="the request decoding")
            os.kill(c.node_pid(decode), signal.SIGTERM)
            events = [e.strip().removeprefix(b"data: ") for e in resp.read().split(b"\n\n") if e.strip()]
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503
        # Issue 30: the router would move it to another decode node; there is none
        assert error["message"] == ("decode-0 is shutting down: the request was cut off after the 0.2 s drain; "
                                    "no other decode node is available to continue it, retry later")
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens, then the error, then [DONE]

        # A lease no decode node reads: the drain waits its 0.2 s for a reader, then releases it.
        msg = GenerationMessage("direct", list(range(1, 40)), SamplingParams(max_tokens=2), b"")
        req = urllib.request.Request(prefill + "/prefill", data=encode_generation(msg), method="POST",
                                     headers={TOKEN_HEADER: c.token, "Content-Type": "application/msgpack"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert decode_prefill_reply(resp.read()).handle is not None
        assert get_json(prefill + "/health")["leases"] == 1
        os.kill(c.node_pid(prefill), signal.SIGTERM)
        wait_for(lambda: any("prefill-0: ended 1 outstanding PrefillTransfer at stop" in line for line in c.log),
                 what="the lease released at stop")
        ended = next(i for i, line in enumerate(c.log) if "ended 1 outstanding PrefillTransfer" in line)
        assert any("prefill-0: " in line and "KV blocks written to disk" in line for line in c.log[ended:])


def test_weights_replaced_in_place_never_get_the_old_weights_disk_kv(tmp_path):
    """Issue 13, test 4: KV on disk belongs to the weights that computed it. A node restarted on
    weights replaced at the same path (same file names and sizes) finds none of the old blocks and
    answers with the new weights' tokens."""
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams
    from kvrelay.model.tiny import write_tiny_model
    from kvrelay.model.tokenizer import load_tokenizer

    model = write_tiny_model(tmp_path / "model", seed=0)
    prompt = list(range(7, 77))  # 4 full blocks

    def reference() -> list[int]:
        [[tokens]] = LLMEngine(load_model(model), EngineConfig(num_blocks=64)).generate(
            [prompt], SamplingParams(max_tokens=6, ignore_eos=True))
        return tokens

    old = reference()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Cluster(model, overrides={"prefill": {"ports": []}, "internal": {"drain_timeout_s": 10}}) as c:
        decode = c.decode_urls[0]
        code, got = post(c.url, body)
        assert code == 200 and got["choices"][0]["text"] == load_tokenizer(model).decode(old)
        # New weights, same names and sizes, moved over the old files (as a deploy would).
        staged = write_tiny_model(tmp_path / "staged", seed=1)
        for f in staged.iterdir():
            os.replace(f, model / f.name)
        new = reference()
        assert new != old
        old_pid = c.node_pid(decode)
        os.kill(old_pid, signal.SIGTERM)  # the drain writes the old weights' blocks to disk

        wait_restarted(c, decode, "decode-0", old_pid)
        written = [line for line in c.log if "decode-0: " in line and "KV blocks written to disk" in line]
        assert written and "decode-0: 0 KV blocks" not in written[-1]
        code, got = post(c.url, body)
        assert code == 200 and got["choices"][0]["text"] == load_tokenizer(model).decode(new)
        assert metrics(decode).get("kvrelay_engine_prefix_hit_tokens_total", 0.0) == 0.0  # nothing old reused
