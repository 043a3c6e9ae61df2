"""Issue 14: nodes found through DNS names (a Kubernetes headless Service answers with one address per
ready pod) instead of fixed URL lists, by the router and by decode nodes checking KV owners."""

from __future__ import annotations

import asyncio
import json
import random

from aiohttp.test_utils import TestClient, TestServer
from kvrelay.benchmarks.deployment import free_ports
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.router.app import Router, RouterConfig
from kvrelay.transfer.config import TOKEN_HEADER

from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_disagg import transfer
from tests.services.test_faults import post, wait_for


def test_router_and_decode_nodes_follow_dns_names_with_the_system_resolver(tiny_model_dir):
    """No URL lists at all: the router resolves ``localhost:<port>`` for each role, and the decode node
    accepts the prefill node's KV because that name resolves to the handle's owner."""
    loaded = load_model(tiny_model_dir)
    prompt = list(range(9, 79))
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    [[want]] = engine.generate([prompt], SamplingParams(max_tokens=5))
    p, d = free_ports(2)
    with Cluster(tiny_model_dir, overrides={"prefill": {"ports": [p]}, "decode": {"ports": [d]}, "router": {
            "prefill_dns": [f"localhost:{p}"], "decode_dns": [f"localhost:{d}"], "dns_interval_s": 1}}) as c:
        want_nodes = {"prefill-0": f"http://127.0.0.1:{p}", "decode-0": f"http://127.0.0.1:{d}"}

        def found() -> dict[str, str]:
            return {name: n["url"] for name, n in get_json(c.url + "/health")["nodes"].items()}

        wait_for(lambda: len(found()) == 2, 30, what="both nodes found")  # each joins once it answers /info
        assert found() == want_nodes
        code, body = post(c.url, {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert code == 200 and body["choices"][0]["text"] == load_tokenizer(tiny_model_dir).decode(want)
        assert transfer(c.decode_urls[0]) == (4 * engine.spec.block_bytes, 0.0)  # pulled, not refused


def test_nodes_join_and_leave_as_their_dns_name_changes(tiny_model_dir):
    """A router whose decode name resolves to one node, then two, then one again: the second joins under
    the name it gives itself and serves requests, then leaves; requests are served throughout."""
    rng = random.Random(3)
    with Cluster(tiny_model_dir, prefill=1, decode=2) as c:
        p = int(c.prefill_urls[0].rsplit(":", 1)[1])
        d0, d1 = (int(u.rsplit(":", 1)[1]) for u in c.decode_urls)
        second: list[str] = []

        async def resolver(host: str, port: int) -> list[str]:
            return second if host == "second.test" else ["127.0.0.1"]

        config = RouterConfig(model_name="tiny", model_dir=str(tiny_model_dir), internal_token=c.token,
                              prefill_dns=(f"prefill.test:{p}",), decode_dns=(f"first.test:{d0}", f"second.test:{d1}"),
                              dns_interval_s=0.2)

        async def main() -> None:
            router = Router(config, resolver=resolver)
            async with TestClient(TestServer(router.make_app())) as client:
                async def until(names: set[str]) -> None:
                    for _ in range(200):
                        nodes = (await (await client.get("/health", headers={TOKEN_HEADER: c.token})).json())["nodes"]
                        if set(nodes) == names and all(n["healthy"] for n in nodes.values()):
                            return
                        await asyncio.sleep(0.05)
                    raise AssertionError(f"nodes never became {names}: {nodes}")

                async def complete() -> int:
                    body = {"model": "tiny", "prompt": [rng.randrange(3, 250) for _ in range(40)], "max_tokens": 3,
                            "temperature": 0, "ignore_eos": True}
                    resp = await client.post("/v1/completions", data=json.dumps(body),
                                             headers={"Content-Type": "application/json"})
                    assert resp.status == 200, await resp.text()
                    return (await resp.json())["usage"]["completion_tokens"]

                await until({"prefill-0", "decode-0"})
                assert await complete() == 3
                second.append("127.0.0.1")  # a pod became ready
                await until({"prefill-0", "decode-0", "decode-1"})
                nodes = (await (await client.get("/health", headers={TOKEN_HEADER: c.token})).json())["nodes"]
                assert nodes["decode-1"]["url"] == f"http://127.0.0.1:{d1}"
                served = metrics(c.decode_urls[1]).get('kvrelay_requests_total{role="decode",status="ok"}', 0.0)
                assert await asyncio.gather(*(complete() for _ in range(4))) == [3] * 4  # together: spread
                assert metrics(c.decode_urls[1])['kvrelay_requests_total{role="decode",status="ok"}'] > served
                second.clear()  # and went away
                await until({"prefill-0", "decode-0"})
                assert await complete() == 3

        asyncio.run(main())
