"""`BodyBuffer`: the request bodies the router holds while it reads and parses them, bounded in bytes.

A body is read into one buffer of its own (not aiohttp's ``request.read()``, which keeps the bytes for the
request's whole life), counted against ``router.max_buffered_body_bytes`` from its first byte (its
``Content-Length`` up front, when sent) until it is parsed, then dropped: a request waiting in the queue
holds its parsed prompt (`router.queue.compact`), not its JSON. Without the bound, clients trickling 1 MiB
bodies (each may take ``router.body_read_timeout_s``, 30 s) could make the router hold 16,384 of them
(``router.max_concurrent_requests``): 16 GiB.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from kvrelay.router.openai_api import ApiError


class BodyRefused(ApiError):
    """A body the router stopped reading (413, 503, 408): the rest may still be on its way, so the connection is
    closed with the answer."""


class BodyBuffer:
    """Reads JSON request bodies within a byte budget shared by every request. Owned by the router's event loop."""

    def __init__(self, *, limit_bytes: int, max_body_bytes: int, timeout_s: float) -> None:
        self.limit_bytes = limit_bytes
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.num_bytes = 0  # bytes of bodies being read or parsed now (only `read_json` changes it)

    async def read_json(self, request: web.Request) -> Any:
        """The request's body, parsed as JSON, read within ``timeout_s``; its bytes are counted from the start
        (its Content-Length, else as they come) until parsed, then dropped.

        Raises:
            BodyRefused: 413 past ``max_body_bytes`` (router.max_body_bytes); 503 when the bodies being read would
                pass ``limit_bytes`` (router.max_buffered_body_bytes); 408 past ``timeout_s``.
            ApiError: 400, the body is not JSON.
        """
        held = [0]  # this body's bytes counted in num_bytes
        try:
            declared = request.content_length
            if declared is not None:
                self._hold(held, declared)
            try:
                raw = await asyncio.wait_for(self._read(request, held), self.timeout_s)
            except asyncio.TimeoutError:
                raise BodyRefused(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                       "(router.body_read_timeout_s); send the whole body at once") from None
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"request body is not valid JSON: {exc}") from None
            except RecursionError:
                raise ApiError(400, "request body is nested too deeply") from None
        finally:
            self.num_bytes -= held[0]

    def _hold(self, held: list[int], total: int) -> None:
        """Count this body (``held[0]`` bytes counted so far) as ``total`` bytes.

        Raises:
            BodyRefused: 413 or 503, see `read_json`.
        """
        if total > self.max_body_bytes:
            raise BodyRefused(413, f"request body exceeds the {self.max_body_bytes}-byte limit (router.max_body_bytes)")
        more = total - held[0]
        if more <= 0:
            return
        if self.num_bytes + more > self.limit_bytes:
            raise BodyRefused(503, f"the router holds {self.num_bytes} bytes of request bodies being read, and this "
                                   f"one would pass its {self.limit_bytes}-byte limit "
                                   "(router.max_buffered_body_bytes); retry later")
        self.num_bytes += more
        held[0] = total

    async def _read(self, request: web.Request, held: list[int]) -> bytearray:
        buf = bytearray()
        while chunk := await request.content.readany():
            buf += chunk
            self._hold(held, len(buf))
        return buf
