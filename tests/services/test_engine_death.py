"""A node whose engine loop has died says so: /health answers 503 with the reason and new requests get
503 at once (nothing waits on a loop that will never run them)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.engine import EngineConfig, LLMEngine
from engine.worker import EngineWorker
from model.loader import load_model
from model.sampling_params import SamplingParams
from node.app import NodeConfig
from prefill.service import PrefillService
from transfer.wire import GenerationMessage, encode_generation


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash, on purpose
def test_a_dead_engine_loop_makes_health_503_and_refuses_requests(tiny_model_dir):
    async def main() -> None:
        worker = EngineWorker(LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=32)))
        service = PrefillService(NodeConfig(role="prefill", name="prefill-0", model_name="tiny"), worker)
        async with TestClient(TestServer(service.make_app(client_max_size=1 << 20))) as client:
            resp = await client.get("/health")
            assert resp.status == 200 and (await resp.json())["status"] == "ok"

            def die() -> None:
                raise SystemExit("simulated crash")  # not an Exception: the loop's guards let it through

            worker._commands.put(die)
            for _ in range(200):
                if not worker.alive:
                    break
                await asyncio.sleep(0.01)
            resp = await client.get("/health")
            body = await resp.json()
            assert resp.status == 503 and body["status"] == "engine_down"
            assert body["error"] == "the engine loop died: SystemExit: simulated crash"
            msg = GenerationMessage("r1", [1, 2, 3], SamplingParams(max_tokens=2), b"")
            resp = await client.post("/prefill", data=encode_generation(msg))
            assert resp.status == 503 and b"engine is not running" in await resp.read()

    asyncio.run(main())
