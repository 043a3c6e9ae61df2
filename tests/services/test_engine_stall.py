"""A hung engine thread, in real node processes (the hang comes from `tests/services/hang_site`, a test-side
sitecustomize; the product has no such knob):

* a node whose engine step hangs past ``engine.stall_timeout_s`` says so on /ready and /health (503 with the
  reason), ends the request waiting on it with a 503 naming the stall (not after ``router.request_timeout_s``),
  and exits, so that `kvrelay up` restarts it;
* pool calls that give blocks back run even when the engine thread was stuck longer than their callers
  waited (`EngineWorker.must_run`): after a hang past `engine.pool_call_timeout_s` no block stays in use.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.worker import EngineWorker
from kvrelay.model.loader import load_model
from kvrelay.model.sampling_params import SamplingParams
from kvrelay.node.app import NodeConfig
from kvrelay.node.app_keys import ENGINE_STALLED
from kvrelay.prefill.service import PrefillService
from kvrelay.transfer.config import TOKEN_HEADER
from kvrelay.transfer.wire import GenerationMessage, encode_generation, unpack

from tests.services.cluster import TEST_TOKEN, Cluster, get_json
from tests.services.test_faults import post, wait_for

HANG_SITE = str(Path(__file__).parent / "hang_site")
STALLED = ("decode-0's engine stalled: no step finished in 5 s (engine.stall_timeout_s) while it had work; "
           "the node exits, to be restarted")
LONG = {"model": "tiny", "prompt": "hang on", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def _hang_env(hang_dir: Path) -> dict[str, str]:
    return {"PYTHONPATH": HANG_SITE, "KVRELAY_TEST_HANG_DIR": str(hang_dir)}


def _arm(trigger: Path, text: str) -> None:
    """Writes a hang trigger (hang_site) whole, at once: the node checks for it before every step, and a file it
    finds between `write_text`'s create and write reads empty (seen once in `make test`)."""
    staged = trigger.with_name(trigger.name + ".staged")
    staged.write_text(text)
    staged.replace(trigger)


def _get(url: str) -> tuple[int, dict] | None:
    """(status, JSON body) of a GET, or None when the node does not answer."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={TOKEN_HEADER: TEST_TOKEN}), timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError:
        return None


def _settled_in_use(urls: list[str], timeout_s: float = 60.0) -> dict[str, int]:
    """Each node's blocks in use, once all are 0 or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        in_use = {url: get_json(url + "/health")["in_use_blocks"] for url in urls}
        if not any(in_use.values()) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.2)


def test_the_watchdog_leaves_an_idle_engine_alone_and_gives_a_stuck_one_up(tiny_model_dir):
    """In one process: an idle node past its stall timeout stays ready; a step stuck past it makes /ready and
    /health 503 with the reason, the request waiting on it a 503 with the reason, and the app's
    ENGINE_STALLED hook runs (`deploy.serve` exits there)."""
    async def main() -> None:
        engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=32))
        real_step, stuck = engine.step, threading.Event()

        def step():
            stuck.wait(60)
            return real_step()

        engine.step = step
        worker = EngineWorker(engine)
        service = PrefillService(NodeConfig(role="prefill", name="prefill-0", model_name="tiny",
                                            stall_timeout_s=0.5), worker)
        app = service.make_app()
        stalls: list[str] = []
        app[ENGINE_STALLED] = stalls.append
        reason = ("prefill-0's engine stalled: no step finished in 0.5 s (engine.stall_timeout_s) while it had "
                  "work; the node exits, to be restarted")
        try:
            async with TestClient(TestServer(app)) as client:
                await asyncio.sleep(2.0)  # idle, four times the stall timeout
                resp = await client.get("/ready")
                assert resp.status == 200 and await resp.json() == {"ready": True}
                msg = GenerationMessage("r1", [1, 2, 3], SamplingParams(max_tokens=2), b"")
                resp = await asyncio.wait_for(client.post("/prefill", data=encode_generation(msg)), 30)
                assert resp.status == 503 and unpack(await resp.read()) == {"error": reason}
                resp = await client.get("/ready")
                assert resp.status == 503
                assert await resp.json() == {"ready": False, "why": "engine_stalled", "error": reason}
                resp = await client.get("/health")
                body = await resp.json()
                assert resp.status == 503 and (body["status"], body["error"]) == ("engine_stalled", reason)
                resp = await client.get("/metrics")
                assert "kvrelay_engine_stalls_total 1.0" in await resp.text()
                for _ in range(500):
                    if stalls:
                        break
                    await asyncio.sleep(0.02)
                assert stalls == [reason]
        finally:
            stuck.set()
        assert await asyncio.to_thread(worker._stopped.wait, 10)  # the thread came back, and its loop returned

    asyncio.run(main())


def test_a_hung_engine_step_makes_the_node_unready_fails_its_request_with_503_and_exits(tiny_model_dir, tmp_path):
    overrides = {"prefill": {"ports": []},  # aggregated: the decode node prefills too
                 "engine": {"stall_timeout_s": 5},
                 "router": {"request_timeout_s": 300}}
    with Cluster(tiny_model_dir, overrides=overrides, env=_hang_env(tmp_path)) as c:
        [node] = c.decode_urls
        old_pid = c.node_pid(node)
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(post, c.url, LONG, 120.0)
            wait_for(lambda: get_json(node + "/health")["running"] == 1, what="the long request running")
            _arm(tmp_path / "decode-0.hang", "600")  # hangs the next step for good
            wait_for(lambda: (tmp_path / "decode-0.hanging").exists(), what="the hang to begin")
            seen: list[tuple[int, dict] | None] = []

            def ready_says_stalled() -> bool:
                seen.append(_get(node + "/ready"))
                return seen[-1] is not None and seen[-1][0] == 503

            wait_for(ready_says_stalled, timeout_s=30, what="/ready to answer 503")
            assert all(s is not None and s[0] == 200 for s in seen[:-1])  # ready until it said why not
            status, body = seen[-1]
            assert body["ready"] is False and body["why"] == "engine_stalled"
            assert body["error"] == STALLED
            health = _get(node + "/health")
            assert health is None or (health[0] == 503 and health[1]["status"] == "engine_stalled"
                                      and health[1]["error"] == body["error"])
            code, answer = request.result(timeout=60)  # well before the router's 300 s request timeout
        assert code == 503
        assert STALLED in answer["error"]["message"]
        # The node exits (code 4) and `kvrelay up` starts a fresh one, which serves.
        wait_for(lambda: any("decode-0 exited with code 4; restarting" in line for line in c.log),
                 timeout_s=60, what="the stalled node to exit")
        wait_for(lambda: (_get(node + "/ready") or (0, {}))[0] == 200, timeout_s=120, what="a fresh node")
        assert c.node_pid(node) != old_pid
        code, answer = post(c.url, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert code == 200 and answer["usage"]["completion_tokens"] == 4


def test_blocks_given_back_during_a_hang_past_the_pool_call_timeout_are_not_lost(tiny_model_dir, tmp_path):
    # The decode engine hangs right after it reserved blocks for a pull: the pull's next pool call (keying
    # the blocks read) waits behind the hang (6 s) longer than its caller (engine.pool_call_timeout_s, 3 s),
    # which gives up and recomputes; the call still runs after the hang and gives the blocks back.
    overrides = {"engine": {"stall_timeout_s": 120,  # the watchdog must not end this node
                            "pool_call_timeout_s": 3},
                 "router": {"request_timeout_s": 300}}
    with Cluster(tiny_model_dir, overrides=overrides, env=_hang_env(tmp_path)) as c:
        [node] = c.decode_urls
        with ThreadPoolExecutor(2) as pool:
            background = pool.submit(post, c.url, LONG, 240.0)  # so the engine steps
            wait_for(lambda: get_json(node + "/health")["running"] == 1, what="the background request running")
            _arm(tmp_path / "decode-0.hang-after-reserve", "6")
            pulled = pool.submit(post, c.url, {"model": "tiny", "prompt": "p" * 64, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True}, 240.0)
            code, answer = pulled.result(timeout=240)
            assert code == 200 and answer["usage"]["completion_tokens"] == 8
            assert (tmp_path / "decode-0.hanging").exists()  # the hang happened
            code, answer = background.result(timeout=240)
            assert code == 200 and answer["usage"]["completion_tokens"] == 1500
        in_use = _settled_in_use(c.prefill_urls + c.decode_urls)
        assert in_use == {url: 0 for url in c.prefill_urls + c.decode_urls}
        assert get_json(node + "/health")["status"] == "ok"
