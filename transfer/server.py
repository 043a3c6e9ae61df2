"""The owner's transfer endpoints, mountable in any aiohttp app (the prefill service mounts them).

    GET  /kv/meta           msgpack `AgentMeta` (see `transfer.wire`)
    POST /kv/lease/renew    msgpack {"v", "lease_id", "binding"} → 200 {"v", "ttl_s"} | 404 (lease gone) |
                            409 (the lease was granted for another handle: `transfer.handle`) | 400 | 413
    POST /kv/lease/release  msgpack {"v", "lease_id"} → 200 {"v", "released"} | 400 | 413  (the router, for
                            a handle no decode node will read: refused, or no decode node left)

All require ``X-Kvrelay-Token`` when ``config.internal_token`` is set (401 otherwise). `bind_socket`
binds loopback unless told otherwise, so the port (and the owner URL that goes into handles) is known
before the app starts. `add_transfer_routes` also runs `KvOwner.run` (notification drain and lease
reaper) for the app's lifetime.

    sock = bind_socket()                                   # 127.0.0.1, a free port
    owner = KvOwner(agent, leases, owner_url=f"http://127.0.0.1:{sock.getsockname()[1]}", config=cfg)
    runner = await start_server(make_transfer_app(owner), sock)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from kvrelay.transfer.config import TOKEN_HEADER
from kvrelay.transfer.lease import BindingMismatch
from kvrelay.transfer.owner import KvOwner
from kvrelay.transfer.wire import (
    MAX_SMALL_MESSAGE_BYTES,
    WireError,
    decode_lease_request,
    decode_renew_request,
    encode_meta,
    encode_release_reply,
    encode_renew_reply,
    read_body,
)

log = logging.getLogger(__name__)
MSGPACK = "application/msgpack"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_transfer_routes(app: web.Application, owner: KvOwner) -> None:
    """Add ``/kv/meta``, ``/kv/lease/renew`` and ``/kv/lease/release`` to ``app`` and run ``owner``'s
    background work with it."""
    token = owner.config.internal_token
    meta_body = encode_meta(owner.agent.meta)

    def guarded(handler: Handler) -> Handler:
        async def check(request: web.Request) -> web.StreamResponse:
            given = request.headers.get(TOKEN_HEADER, "")
            if token is not None and not hmac.compare_digest(given.encode(), token.encode()):
                return web.Response(status=401, text=f"missing or wrong {TOKEN_HEADER}")
            return await handler(request)
        return check

    async def get_meta(request: web.Request) -> web.Response:
        return web.Response(body=meta_body, content_type=MSGPACK)

    async def lease_body(request: web.Request) -> bytes | web.Response:
        if request.content_length is not None and request.content_length > MAX_SMALL_MESSAGE_BYTES:
            return web.Response(status=413, text=f"a lease request is at most {MAX_SMALL_MESSAGE_BYTES} bytes")
        try:
            return await read_body(request.content, max_bytes=MAX_SMALL_MESSAGE_BYTES, what="lease request")
        except WireError as exc:
            return web.Response(status=400, text=str(exc))

    async def release(request: web.Request) -> web.Response:
        body = await lease_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            lease_id = decode_lease_request(body)
        except WireError as exc:
            return web.Response(status=400, text=str(exc))
        return web.Response(body=encode_release_reply(await owner.release(lease_id)), content_type=MSGPACK)

    async def renew(request: web.Request) -> web.Response:
        body = await lease_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            req = decode_renew_request(body)
        except WireError as exc:
            return web.Response(status=400, text=str(exc))
        try:
            ttl_s = await owner.renew(req.lease_id, req.binding)
        except BindingMismatch as exc:
            return web.Response(status=409, text=str(exc))
        if ttl_s is None:
            return web.Response(status=404, text="lease expired or released")
        return web.Response(body=encode_renew_reply(ttl_s), content_type=MSGPACK)

    async def background(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(owner.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.router.add_get("/kv/meta", guarded(get_meta))
    app.router.add_post("/kv/lease/renew", guarded(renew))
    app.router.add_post("/kv/lease/release", guarded(release))
    app.cleanup_ctx.append(background)


def make_transfer_app(owner: KvOwner) -> web.Application:
    """A stand-alone app with only the transfer endpoints (small request bodies)."""
    app = web.Application(client_max_size=64 * 1024)
    add_transfer_routes(app, owner)
    return app


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one), for `start_server`."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def start_server(app: web.Application, sock: socket.socket) -> web.AppRunner:
    """Serve ``app`` on ``sock``; stop with ``await runner.cleanup()``."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner
