"""`router.backends.Backends.poll`, the router's health poll, against real loopback servers (issue 30, failure
mode 6): it has connections of its own (lease releases stuck on a slow node do not delay it), a slow answer is
`NodeSlow` (not a reason to take the node out) and only a failed connect is `NodeUnreachable`."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kvrelay.router.backends import CONTROL_CONNECTIONS_PER_NODE, Backends, NodeSlow, NodeUnreachable
from kvrelay.router.nodes import NodeSet
from kvrelay.transfer.wire import pack


async def _slow_node() -> tuple[TestServer, list[int]]:
    """/kv/lease/release never answers (an engine that takes its time); /kv/events answers after
    ``?delay_s=``. The list counts the releases that arrived."""
    releases: list[int] = []
    hang = asyncio.Event()  # never set

    async def release(request: web.Request) -> web.Response:
        releases.append(1)
        await hang.wait()
        raise AssertionError("never answered")

    async def events(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("delay_s", "0")))
        return web.Response(body=pack({"last_seq": 0}), content_type="application/msgpack")

    app = web.Application()
    app.router.add_post("/kv/lease/release", release)
    app.router.add_get("/kv/events", events)
    server = TestServer(app)
    await server.start_server()
    return server, releases


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_health_poll_has_its_own_connections_and_tells_slow_from_unreachable():
    async def main() -> None:
        server, releases = await _slow_node()
        nodes = NodeSet([str(server.make_url("")).rstrip("/"), f"http://127.0.0.1:{_closed_port()}"], ["http://x"],
                        block_size_tokens=16)
        slow, gone = nodes.prefill
        backends = Backends(internal_token=None, timeout_s=600, connect_timeout_s=2)
        await backends.start()
        stuck = [asyncio.ensure_future(backends.release_lease(slow, f"lease-{i}", timeout_s=60))
                 for i in range(2 * CONTROL_CONNECTIONS_PER_NODE)]
        try:
            while len(releases) < CONTROL_CONNECTIONS_PER_NODE:  # every control connection is taken
                await asyncio.sleep(0.01)
            assert await asyncio.wait_for(backends.poll(slow, "/kv/events", timeout_s=30), 10) == {"last_seq": 0}
            with pytest.raises(NodeSlow, match=r"prefill-0: GET /kv/events\?delay_s=3 was not answered within 0.5 s"):
                await backends.poll(slow, "/kv/events?delay_s=3", timeout_s=0.5)
            with pytest.raises(NodeUnreachable, match="prefill-1: cannot connect to http://127.0.0.1:"):
                await backends.poll(gone, "/kv/events", timeout_s=30)
            assert len(releases) == CONTROL_CONNECTIONS_PER_NODE and not any(t.done() for t in stuck)
        finally:
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
            await backends.close()
            await server.close()

    asyncio.run(main())
