"""`write_within`: one step of an HTTP answer that a reader who stopped reading cannot hold forever.

Shared by the router (answers to clients) and the decode node (frames to the router): aiohttp's
``write`` waits for the socket to drain, so a peer that stops reading blocks it with no bound.
"""

from __future__ import annotations

import asyncio

from aiohttp import web


async def write_within(request: web.Request, resp: web.StreamResponse, data: bytes = b"", *, eof: bool = False,
                       timeout_s: float) -> bool:
    """Prepare ``resp`` if needed, write ``data``, then end the answer if ``eof``: each step within
    ``timeout_s`` seconds. False when a step did not finish in time: the connection is then cut (aborted),
    and the caller says why and ends its request."""
    try:
        if not resp.prepared:
            await asyncio.wait_for(resp.prepare(request), timeout_s)
        if data:
            await asyncio.wait_for(resp.write(data), timeout_s)
        if eof:
            await asyncio.wait_for(resp.write_eof(), timeout_s)
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        return False
    return True
