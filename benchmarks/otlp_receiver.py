"""`OtlpReceiver`: a small OTLP/HTTP trace collector on a loopback port, for tests and benchmarks.

    with OtlpReceiver() as rx:                      # serves POST /v1/traces on its own thread and event loop
        config observability.otlp_endpoint = rx.url
        ...
        spans = rx.wait_for(lambda spans: len(spans) >= 12, timeout_s=30)

Each POST body is an ``ExportTraceServiceRequest`` (protobuf, as `OTLPSpanExporter` sends it; gzip accepted);
its spans are kept as `ReceivedSpan` records, in arrival order.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span as the collector got it (ids as hex; ``parent_id`` "" for a root span)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return None if kind is None else getattr(v, kind)


def parse_export(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest``. Raises google.protobuf's DecodeError if malformed."""
    req = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    str(resource.get("service.name", "")), s.name, s.trace_id.hex(), s.span_id.hex(),
                    s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano,
                    {a.key: _value(a.value) for a in s.attributes}, s.status.code == STATUS_ERROR))
    return out


class OtlpReceiver:
    """Collects the spans POSTed to `url` (``http://127.0.0.1:PORT/v1/traces``) until `stop`."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.num_requests = 0  # export requests received (each a batch of spans)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self.url = ""

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if body[:2] == b"\x1f\x8b":  # gzip the server did not undo
            body = gzip.decompress(body)
        spans = parse_export(body)
        with self._lock:
            self._spans.extend(spans)
            self.num_requests += 1
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._export)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        self._stopped = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        try:
            await self._stopped.wait()
        finally:
            await runner.cleanup()

    def start(self) -> OtlpReceiver:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="otlp-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the OTLP receiver did not start within 10 s")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(10)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far (a copy)."""
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], *, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once ``done(spans)`` holds. Raises TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OTLP receiver has {len(spans)} spans after {timeout_s:g} s: "
                                   f"{sorted({(s.service, s.name) for s in spans})}")
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
