"""`router.backends.Backends` against a node that stops answering without closing anything (a host
that dropped off the network): the health poll's verdict ends the requests waiting on it."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kvrelay.router.backends import Backends, NodeUnavailable
from kvrelay.router.nodes import NodeSet
from kvrelay.transfer.wire import pack


async def _silent_node() -> tuple[TestServer, asyncio.Event]:
    """/prefill never answers; /generate sends one frame, then nothing. ``entered`` is set on arrival."""
    entered = asyncio.Event()
    hang = asyncio.Event()  # never set

    async def prefill(request: web.Request) -> web.Response:
        entered.set()
        await hang.wait()
        raise AssertionError("unreachable")

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/msgpack"})
        await resp.prepare(request)
        await resp.write(pack({"index": 0, "tokens": [7], "finished": False, "reason": None}))
        entered.set()
        await hang.wait()
        return resp

    app = web.Application()
    app.router.add_post("/prefill", prefill)
    app.router.add_post("/generate", generate)
    server = TestServer(app)
    await server.start_server()
    return server, entered


@pytest.mark.parametrize("path", ["/prefill", "/generate"])
def test_a_node_found_unreachable_ends_the_requests_waiting_on_it(path):
    async def main() -> None:
        server, entered = await _silent_node()
        nodes = NodeSet([str(server.make_url(""))], [], block_size_tokens=16)
        [node] = nodes.prefill
        backends = Backends(internal_token=None, timeout_s=600)
        await backends.start()
        try:
            async def call() -> list:
                if path == "/prefill":
                    return [await backends.post(node, path, b"x")]
                return [frame async for frame in backends.stream(node, path, b"x")]

            task = asyncio.ensure_future(call())
            await asyncio.wait_for(entered.wait(), 10)
            await asyncio.sleep(0.05)
            assert not task.done()
            nodes.mark_unreachable(node, "GET /kv/events timed out")
            with pytest.raises(NodeUnavailable, match="prefill-0") as err:
                await asyncio.wait_for(task, 5)  # at once, not after the 600 s read timeout
            assert "unreachable" in str(err.value)
            assert node.readers == set() and not node.healthy(time.monotonic())  # taken out
            # Later requests wait on a fresh signal: the node is not refused for good.
            assert not node.lost.is_set()
        finally:
            await backends.close()
            await server.close()

    asyncio.run(main())
