"""HTTP calls from the router to prefill and decode nodes (msgpack, bounded waits)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from router.nodes import Node
from transfer.config import TOKEN_HEADER
from transfer.wire import WireError, new_unpacker, unpack


class NodeUnavailable(Exception):
    """The node did not answer, broke the connection, or failed with a 5xx: route elsewhere."""


class NodeRefused(Exception):
    """The node answered with a 4xx: the request itself is at fault (or the node is full: 429)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Backends:
    """One aiohttp session for every internal call. ``timeout_s`` bounds connects and each read."""

    def __init__(self, *, internal_token: str | None, timeout_s: float) -> None:
        self._headers = {"Content-Type": "application/msgpack"}
        if internal_token:
            self._headers[TOKEN_HEADER] = internal_token
        self._timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Backends.start() was not called"
        return self._session

    async def _check(self, node: Node, resp: aiohttp.ClientResponse) -> None:
        if resp.status < 400:
            return
        body = await resp.read()
        try:
            message = str(unpack(body).get("error", body[:200]))
        except (WireError, AttributeError):
            message = body[:200].decode(errors="replace")
        if resp.status >= 500 and resp.status not in (502,):
            raise NodeUnavailable(f"{node.name} answered {resp.status}: {message}")
        raise NodeRefused(resp.status, message)

    async def get_msgpack(self, node: Node, path: str, *, timeout_s: float = 5.0) -> Any:
        try:
            async with self.session.get(node.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await self._check(node, resp)
                return unpack(await resp.read())
        except (aiohttp.ClientError, TimeoutError, WireError) as exc:
            raise NodeUnavailable(f"{node.name}: GET {path} failed: {exc!r}") from None

    async def post(self, node: Node, path: str, body: bytes) -> bytes:
        """POST an encoded message (`transfer.wire`); the answer's bytes, for the caller to decode."""
        try:
            async with self.session.post(node.url + path, data=body) as resp:
                await self._check(node, resp)
                return await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise NodeUnavailable(f"{node.name}: POST {path} failed: {exc!r}") from None

    async def stream(self, node: Node, path: str, body: bytes) -> AsyncIterator[Any]:
        """POST an encoded message, then yield each msgpack object of the streamed answer (decode
        them with `transfer.wire.decode_frame`).

        Raises:
            NodeUnavailable: before or during the stream (connection lost, node died).
            NodeRefused: the node refused the request.
        """
        try:
            async with self.session.post(node.url + path, data=body) as resp:
                await self._check(node, resp)
                unpacker = new_unpacker()
                async for chunk in resp.content.iter_any():
                    unpacker.feed(chunk)
                    for frame in unpacker:
                        yield frame
                if resp.content.exception() is not None:
                    raise NodeUnavailable(f"{node.name}: stream broke: {resp.content.exception()!r}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise NodeUnavailable(f"{node.name}: stream from {path} failed: {exc!r}") from None
