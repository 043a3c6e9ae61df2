"""A node whose engine loop has died says so: /health answers 503 with the reason and new requests get
503 at once (nothing waits on a loop that will never run them); the request in it ends with the reason
and the node's process exits, so that `kvrelay up` restarts it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvrelay.deploy.ports import free_ports
from kvrelay.deploy.serve import ENGINE_DIED_EXIT
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.worker import EngineWorker, _Command
from kvrelay.model.loader import load_model
from kvrelay.model.sampling_params import SamplingParams
from kvrelay.node.app import NodeConfig
from kvrelay.prefill.service import PrefillService
from kvrelay.transfer.config import TOKEN_HEADER
from kvrelay.transfer.wire import GenerationMessage, encode_generation, unpack


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash, on purpose
def test_a_dead_engine_loop_makes_health_503_and_refuses_requests(tiny_model_dir):
    async def main() -> None:
        worker = EngineWorker(LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=32)))
        service = PrefillService(NodeConfig(role="prefill", name="prefill-0", model_name="tiny"), worker)
        async with TestClient(TestServer(service.make_app(client_max_size=1 << 20))) as client:
            resp = await client.get("/health")
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
            resp = await client.get("/ready")
            assert resp.status == 200 and await resp.json() == {"ready": True}

            def die() -> None:
                raise SystemExit("simulated crash")  # not an Exception: the loop's guards let it through

            worker._commands.put(_Command(die))
            for _ in range(200):
                if not worker.alive:
                    break
                await asyncio.sleep(0.01)
            resp = await client.get("/health")
            body = await resp.json()
            assert resp.status == 503 and body["status"] == "engine_down"
            assert body["error"] == "the engine loop died: SystemExit: simulated crash"
            resp = await client.get("/ready")
            assert resp.status == 503 and await resp.json() == {"ready": False, "why": "engine_down"}
            msg = GenerationMessage("r1", [1, 2, 3], SamplingParams(max_tokens=2), b"")
            resp = await client.post("/prefill", data=encode_generation(msg))
            assert resp.status == 503 and b"engine is not running" in await resp.read()

    asyncio.run(main())


# A prefill node whose engine raises SystemExit on its first step (the crash is patched in here, in the
# test's process, not built into the server).
CRASHING_NODE = """
import sys
import kvrelay.engine.engine

def step(self):
    raise SystemExit("simulated crash")

kvrelay.engine.engine.LLMEngine.step = step
from kvrelay.deploy.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_node_whose_engine_loop_dies_fails_its_request_and_exits(tiny_model_dir, tmp_path):
    [port] = free_ports(1)
    cfg = tmp_path / "prefill.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_dir}, dtype: float32}}\nkvstore: {{device: {{bytes: 8MiB}}}}\n"
                   f"prefill: {{ports: [{port}]}}\n")
    env = {**os.environ, "KVRELAY_INTERNAL_TOKEN": "t0ken"}
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_NODE, "prefill", "--config", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the node did not come up"
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        msg = GenerationMessage("r1", [1, 2, 3], SamplingParams(max_tokens=2), b"")
        req = urllib.request.Request(url + "/prefill", data=encode_generation(msg), method="POST",
                                     headers={TOKEN_HEADER: "t0ken", "Content-Type": "application/msgpack"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 503  # the node is going away: the router may send the request elsewhere
        assert unpack(err.value.read()) == {"error": "the engine loop died: SystemExit: simulated crash"}
        assert proc.wait(timeout=60) == ENGINE_DIED_EXIT
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.communicate()[1]
    assert "the engine loop died: SystemExit: simulated crash" in stderr
