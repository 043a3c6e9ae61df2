"""HTTP calls from the router to prefill and decode nodes (msgpack, bounded waits)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiohttp
from kvrelay.router.node_state import Node
from kvrelay.router.nodes import NodeLost
from kvrelay.transfer.config import TOKEN_HEADER, client_keepalive_s
from kvrelay.transfer.wire import WireError, decode_release_reply, encode_lease_request, new_unpacker, unpack

log = logging.getLogger(__name__)
T = TypeVar("T")
CONTROL_CONNECTIONS_PER_NODE = 4  # a few /info or lease calls at a time
HEALTH_CONNECTIONS_PER_NODE = 2  # the event long poll (one at a time), on connections nothing else waits for


class NodeUnavailable(Exception):
    """The node did not answer, broke the connection, or answered a 5xx (on a request path only a 503: see
    `NodeRefused`); the subclasses say which, and `router.dispatch` decides whether the request may go elsewhere."""


class NodeUnreachable(NodeUnavailable):
    """No connection to the node could be made (refused, or the connect timed out): it is gone. On a request
    path, the request was never sent, so it may go to another node."""


class NodeLeaving(NodeUnavailable):
    """The node answered 503 (an answer or a stream's error frame): it is going away (draining, its engine given
    up or stopped), so another node may serve the request."""


class NodeBroke(NodeUnavailable):
    """The request was sent, then its answer broke (connection lost, no answer in time, a stream that ended
    early). Either the node died (``lost``: the health poll already found it unreachable) or it ended this request
    alone (e.g. cut off a reader that stalled): the caller asks the node (`router.dispatch`)."""

    def __init__(self, message: str, *, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost


class NodeSlow(NodeUnavailable):
    """The node took the connection but did not answer in time: slow, not gone."""


class NodeRefused(Exception):
    """The node answered with a 4xx: the request itself is at fault (or the node is full: 429); on a request
    path (`Backends.post`, `Backends.stream`) also a 5xx other than 503: the request failed there, the node
    is up."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Backends:
    """The router's internal HTTP clients: one session for requests (prefill, decode streams), one for
    control calls (``/info``, lease releases) and one for the ``/kv/events`` health polls (`poll`), so that
    neither a saturated request pool nor lease releases queued on a slow node ever delay the polls that
    decide whether a node is alive.

    Args:
        internal_token: sent to the nodes in `transfer.config.TOKEN_HEADER`.
        timeout_s: the longest wait for each read of an answer (a node that stops answering).
        connect_timeout_s: the TCP connect alone. Waiting for a free pooled connection is not a connect
            failure and is not timed here (the request's own deadline bounds it), so load never takes
            a healthy node out.
        max_connections_per_node: pooled request connections per node (each running request holds one).
        node_keepalive_s: the nodes' idle-connection timeout; pooled connections idle for
            `transfer.config.client_keepalive_s` of it are closed here first.
    """

    def __init__(self, *, internal_token: str | None, timeout_s: float, connect_timeout_s: float = 5.0,
                 max_connections_per_node: int = 1024, node_keepalive_s: float = 75.0) -> None:
        self._headers = {"Content-Type": "application/msgpack"}
        if internal_token:
            self._headers[TOKEN_HEADER] = internal_token
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s)
        self._connect_timeout_s = connect_timeout_s
        self._limit = max_connections_per_node
        self._keepalive_s = client_keepalive_s(node_keepalive_s)
        self._session: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None
        self._health: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        def pool(per_node: int) -> aiohttp.TCPConnector:
            return aiohttp.TCPConnector(limit=0, limit_per_host=per_node, keepalive_timeout=self._keepalive_s)

        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers, connector=pool(self._limit))
        self._control = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers,
                                              connector=pool(CONTROL_CONNECTIONS_PER_NODE))
        self._health = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers,
                                             connector=pool(HEALTH_CONNECTIONS_PER_NODE))

    async def close(self) -> None:
        for session in (self._session, self._control, self._health):
            if session is not None:
                await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Backends.start() was not called"
        return self._session

    @property
    def control(self) -> aiohttp.ClientSession:
        assert self._control is not None, "Backends.start() was not called"
        return self._control

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

    async def _check_request(self, node: Node, resp: aiohttp.ClientResponse) -> None:
        """`_check` for a request's answer: 503 is the node going away (`NodeLeaving`); any other 5xx is this
        request's failure (`NodeRefused`), not the node's."""
        try:
            await self._check(node, resp)
        except NodeUnavailable as exc:
            if resp.status == 503:
                raise NodeLeaving(str(exc)) from None
            raise NodeRefused(resp.status, str(exc)) from None

    async def get_msgpack(self, node: Node, path: str, *, timeout_s: float = 5.0) -> Any:
        try:
            async with self.control.get(node.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await self._check(node, resp)
                return unpack(await resp.read())
        except (aiohttp.ClientError, TimeoutError, WireError) as exc:
            raise NodeUnavailable(f"{node.name}: GET {path} failed: {exc!r}") from None

    async def poll(self, node: Node, path: str, *, timeout_s: float) -> Any:
        """GET ``path`` (a health poll) on connections of its own: the connect within ``connect_timeout_s``,
        the answer within ``timeout_s`` after it.

        Raises:
            NodeUnreachable: the connect failed (refused, or timed out).
            NodeSlow: connected, but no whole answer in time.
            NodeUnavailable: the node broke the connection, answered a 5xx or a malformed body.
            NodeRefused: a 4xx.
        """
        assert self._health is not None, "Backends.start() was not called"
        timeout = aiohttp.ClientTimeout(total=self._connect_timeout_s + timeout_s,
                                        sock_connect=self._connect_timeout_s)
        try:
            async with self._health.get(node.url + path, timeout=timeout) as resp:
                await self._check(node, resp)
                return unpack(await resp.read())
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise NodeUnreachable(f"{node.name}: cannot connect to {node.url}: {exc!r}") from None
        except TimeoutError:  # asyncio.TimeoutError: no answer in time on a connection that was made
            raise NodeSlow(f"{node.name}: GET {path} was not answered within {timeout_s:g} s") from None
        except (aiohttp.ClientError, WireError) as exc:
            raise NodeUnavailable(f"{node.name}: GET {path} failed: {exc!r}") from None

    async def is_up(self, node: Node, *, timeout_s: float) -> bool:
        """Whether ``node`` is up: its ``/ready`` answers, on the health poll's connections, within
        ``connect_timeout_s`` + ``timeout_s``. A refused or timed-out connect, a broken connection or a
        non-200 answer (draining, engine down or given up) is down; a node that took the connection but
        did not answer in time is counted up (slow, not gone: `NodeSlow`)."""
        assert self._health is not None, "Backends.start() was not called"
        timeout = aiohttp.ClientTimeout(total=self._connect_timeout_s + timeout_s,
                                        sock_connect=self._connect_timeout_s)
        try:
            async with self._health.get(node.url + "/ready", timeout=timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
            return False
        except TimeoutError:
            return True
        except aiohttp.ClientError:
            return False

    async def release_lease(self, node: Node, lease_id: str, *, timeout_s: float = 5.0) -> bool:
        """Ask prefill ``node`` to drop a lease no decode node will read. Whether it still held it;
        False also when the node did not answer (its lease then ends with its TTL)."""
        try:
            async with self.control.post(node.url + "/kv/lease/release", data=encode_lease_request(lease_id),
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await self._check(node, resp)
                return decode_release_reply(await resp.read())
        except (aiohttp.ClientError, TimeoutError, WireError, NodeUnavailable, NodeRefused) as exc:
            log.warning("%s: releasing lease %s failed (%s); it ends with its TTL", node.name, lease_id, exc)
            return False

    async def post(self, node: Node, path: str, body: bytes, *, headers: Mapping[str, str] | None = None) -> bytes:
        """POST an encoded message (`transfer.wire`); the answer's bytes, for the caller to decode. ``headers``:
        sent besides the session's (a ``traceparent``).

        Raises:
            NodeUnreachable: the connect failed (the request was never sent).
            NodeLeaving: a 503.
            NodeBroke: sent, then no answer, a broken connection, or the node was found unreachable
                (`Node.lost`) while this waited.
            NodeRefused: a 4xx, or another 5xx.
        """
        try:
            resp = await _unless_lost(node, self.session.post(node.url + path, data=body, headers=headers))
            node.readers.add(resp.content)
            try:
                await self._check_request(node, resp)
                return await resp.read()
            finally:
                node.readers.discard(resp.content)
                resp.release()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise NodeUnreachable(f"{node.name}: cannot connect to {node.url}: {exc!r}") from None
        except NodeLost as exc:
            raise NodeBroke(f"{node.name}: POST {path} failed: {exc}", lost=True) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise NodeBroke(f"{node.name}: POST {path} failed: {exc!r}") from None

    async def stream(self, node: Node, path: str, body: bytes, *,
                     on_headers: Callable[[Mapping[str, str]], None] | None = None,
                     headers: Mapping[str, str] | None = None) -> AsyncIterator[Any]:
        """POST an encoded message, then yield each msgpack object of the streamed answer (decode
        them with `transfer.wire.decode_frame`). ``on_headers`` hears the answer's headers first (also
        those of a refusal); ``headers`` are sent besides the session's (a ``traceparent``).

        Raises:
            NodeUnreachable: the connect failed (the request was never sent).
            NodeLeaving: a 503.
            NodeBroke: the stream broke after the request was sent (connection lost, node died or cut it).
            NodeRefused: the node refused the request (4xx), or failed it (another 5xx).
        """
        try:
            resp = await _unless_lost(node, self.session.post(node.url + path, data=body, headers=headers))
            node.readers.add(resp.content)
            try:
                if on_headers is not None:
                    on_headers(resp.headers)
                await self._check_request(node, resp)
                unpacker = new_unpacker()
                async for chunk in resp.content.iter_any():
                    unpacker.feed(chunk)
                    for frame in unpacker:
                        yield frame
                if isinstance(resp.content.exception(), NodeLost):
                    raise resp.content.exception()
                if resp.content.exception() is not None:
                    raise NodeBroke(f"{node.name}: stream broke: {resp.content.exception()!r}")
            finally:
                node.readers.discard(resp.content)
                resp.release()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise NodeUnreachable(f"{node.name}: cannot connect to {node.url}: {exc!r}") from None
        except NodeLost as exc:
            raise NodeBroke(f"{node.name}: stream from {path} failed: {exc}", lost=True) from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise NodeBroke(f"{node.name}: stream from {path} failed: {exc!r}") from None


async def _unless_lost(node: Node, aw: Awaitable[T]) -> T:
    """``await aw`` (a request until its answer begins), unless the health poll finds ``node``
    unreachable first (`Node.lost`): then cancel it and raise `NodeLost`."""
    lost = node.lost
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise NodeLost(f"{node.name} became unreachable while serving this request ({node.last_error})")
    return work.result()
