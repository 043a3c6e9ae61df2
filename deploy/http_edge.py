"""The HTTP edge of every kvrelay server (the router and each node): a deadline on request headers, a cap on open
connections that refuses fast, and the file-descriptor limit both are sized against.

Without them a client that opens connections and never finishes a request's headers holds each one (aiohttp
closes it only after ``keepalive_timeout_s``, 75 s), and enough of them use up the process's descriptors: the
server stops accepting, and the router's own connects to its nodes fail with EMFILE, which takes the nodes out.

Descriptor budget of one process (``limit`` = RLIMIT_NOFILE after `raise_fd_limit`)::

    | open client connections <= max_open_connections | node traffic, files, the loop ... (the rest) |
    0                                  default: limit // 2                                          limit

A connection over the cap is accepted and answered at once with a minimal 503 (``Connection: close``), so a
client learns to back off rather than waiting in the kernel's backlog. Connections already open are not touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

# Descriptors a process needs besides its client connections at the least: log files, LMDB, NIXL, pipes, the
# event loop's own (a node at rest holds ~60 here).
FD_RESERVE = 128
# A hard limit of RLIM_INFINITY cannot be a soft one (setrlimit refuses above fs.nr_open, 1,048,576 by default).
_INFINITE_FD_LIMIT = 1 << 20
# How long a refused connection is kept to let its 503 reach the client before the close (closing with the
# client's request unread would reset the connection and could drop the 503).
_REFUSE_LINGER_S = 1.0


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """One server's edge limits, resolved against its descriptor limit (`edge_limits`).

    Attributes:
        header_read_timeout_s: a connection's request line and headers must be in within this from the
            connection's start, or from the first byte of a later request on a kept-alive connection; else the
            server answers 408 and closes it (the wait for that first byte is bounded by keep-alive).
        max_open_connections: open client connections; one more is answered 503 and closed.
        key_prefix: the YAML section the values came from, for messages (``router`` or ``internal``).
    """

    header_read_timeout_s: float
    max_open_connections: int
    key_prefix: str = "router"


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (as Go does at start) and return the new soft
    limit. A hard limit that cannot be set (infinite, above fs.nr_open) leaves the soft one where it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _INFINITE_FD_LIMIT if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, wanted, exc)
    return _INFINITE_FD_LIMIT if soft == resource.RLIM_INFINITY else soft


def edge_limits(*, header_read_timeout_s: float, max_open_connections: int | None, fd_limit: int,
                key_prefix: str) -> EdgeLimits:
    """The limits of a server whose process may hold ``fd_limit`` descriptors.

    ``max_open_connections`` None takes half of ``fd_limit``, keeping the other half for the server's own
    connections (the router's to its nodes, a decode node's to prefill nodes) and files.

    Raises:
        ValueError: ``max_open_connections`` leaves fewer than `FD_RESERVE` descriptors, naming the key and limit.
    """
    if max_open_connections is None:
        max_open_connections = max(1, fd_limit // 2)
    elif max_open_connections > fd_limit - FD_RESERVE:
        raise ValueError(
            f"{key_prefix}.max_open_connections: {max_open_connections} connections do not fit the open-file limit "
            f"of {fd_limit} (ulimit -n) less {FD_RESERVE} kept for the server's own files and connections; lower "
            f"it to at most {fd_limit - FD_RESERVE}, or raise the limit")
    return EdgeLimits(header_read_timeout_s=header_read_timeout_s, max_open_connections=max_open_connections,
                      key_prefix=key_prefix)


def admitted_requests_cap(max_concurrent_requests: int, *, limits: EdgeLimits, fd_limit: int) -> int:
    """``router.max_concurrent_requests`` clamped to the descriptors left after the client connections: each
    admitted request may hold a connection to a prefill node and one to a decode node at once. Logs a warning
    naming both keys when it clamps."""
    fit = max(1, (fd_limit - limits.max_open_connections - FD_RESERVE) // 2)
    if max_concurrent_requests <= fit:
        return max_concurrent_requests
    log.warning("router.max_concurrent_requests %d is lowered to %d: with an open-file limit of %d (ulimit -n) and "
                "%d client connections (router.max_open_connections), %d requests can hold their two node "
                "connections each; raise the limit to admit more", max_concurrent_requests, fit, fd_limit,
                limits.max_open_connections, fit)
    return fit


def _minimal_response(status: str, reason: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": reason, "type": "server_error", "code": int(status[:3])}}).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
            f"Connection: close\r\n\r\n").encode() + body


class EdgeHandler(RequestHandler):
    """aiohttp's connection handler with a header-read deadline, and the refusal of connections over the cap.

    The deadline runs while no complete request head is in: from `connection_made`, and from the first byte
    received while the connection waits for its next request. A complete head cancels it (the body has its own
    deadline in the router, ``router.body_read_timeout_s``).
    """

    __slots__ = ("_limits", "_header_deadline", "_refused")

    def __init__(self, manager: web.Server, *, limits: EdgeLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._header_deadline: asyncio.TimerHandle | None = None
        self._refused: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        assert manager is not None
        if len(manager.connections) >= self._limits.max_open_connections:
            self._refuse(transport)  # type: ignore[arg-type]
            return
        super().connection_made(transport)
        self._arm_header_deadline()

    def _refuse(self, transport: asyncio.Transport) -> None:
        self._refused = transport
        transport.write(_minimal_response(
            "503 Service Unavailable", f"too many open connections ({self._limits.max_open_connections}, "
            f"{self._limits.key_prefix}.max_open_connections); retry later", "Retry-After: 1\r\n"))
        if transport.can_write_eof():
            transport.write_eof()  # the client reads the 503, then sees the end; its close ends ours
        self._loop.call_later(_REFUSE_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return  # a refused connection's request is read and dropped
        if self._header_deadline is None and self._waiter is not None:  # the first byte of a next request
            self._arm_header_deadline()
        super().data_received(data)
        if self._messages:
            self._cancel_header_deadline()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused is not None:
            self._refused.close()
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is not None:
            self._refused = None
            return
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._header_deadline = self._loop.call_later(self._limits.header_read_timeout_s, self._header_overdue)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_overdue(self) -> None:
        self._header_deadline = None
        transport = self.transport
        if transport is None or self._messages or self._request_in_progress:
            return
        transport.write(_minimal_response(
            "408 Request Timeout", f"the request headers did not arrive within {self._limits.header_read_timeout_s:g} "
            f"s ({self._limits.key_prefix}.header_read_timeout_s)"))
        self.force_close()
        transport.close()


class EdgeServer(web.Server):
    """`aiohttp.web.Server` whose connections are `EdgeHandler` s under ``limits``."""

    def __init__(self, *args: Any, limits: EdgeLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits

    def __call__(self) -> RequestHandler:
        return EdgeHandler(self, limits=self._limits, loop=self._loop, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """`aiohttp.web.AppRunner` serving its app through an `EdgeServer`."""

    __slots__ = ("_limits",)

    def __init__(self, app: web.Application, *, limits: EdgeLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup, as AppRunner does
        return EdgeServer(plain.request_handler, request_factory=plain.request_factory, loop=plain._loop,
                          handler_cancellation=plain.handler_cancellation, limits=self._limits, **plain._kwargs)
