"""`Tracing`: one process's request traces (OpenTelemetry), handed to the router and node apps as an object.

    Tracing.to_endpoint(url, service="kvrelay-router", instance="router-0")   OTLP over HTTP, batched export
    Tracing.off()                                                              nothing recorded (no endpoint)
    Tracing(provider)                                                          any SDK provider (tests: in memory)

One trace per request. Its spans are made with explicit start and end times: `time.time_ns()` stamps taken
where the work happened (on the event loop, or on the engine thread: `engine.worker.EngineTimes`), so no
tracing context travels through the engine. Between processes the W3C ``traceparent`` header carries the
parent span: the caller sends `headers_for(span)`, the callee reads `parent_from(request.headers)`. A client's
header at the router (`parent_from_client`) names the parent but cannot switch sampling off: the server traces
its own requests.

Off (no endpoint) `tracer` is None, and every method returns at once after that check: no span objects,
no header parsing, no export thread. Callers that build attributes check ``tracing.tracer is None`` first.

Errors never reach the caller: a collector that is down costs log lines (the SDK's), never a request.
No module state: the provider, its exporter thread and the propagator belong to this object; `aclose`
flushes the spans still queued and stops the exporter (a planned stop's cleanup, after the drain).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
TRACEPARENT = "traceparent"
EXPORT_INTERVAL_S = 1.0  # how often queued spans go to the collector
EXPORT_TIMEOUT_S = 5.0  # one export's bound (the exporter's retries included)
CLOSE_TIMEOUT_S = 10.0  # `aclose`'s bound on the last flush
INSTRUMENTATION = "kvrelay"

AttrValue = Union[str, bool, int, float, Sequence[str], Sequence[int], Sequence[float]]
Parent = Union[Span, Context, None]


@dataclass(frozen=True, slots=True)
class Stage:
    """One timed stage of a request: a span named ``name`` from ``start_ns`` to ``end_ns`` (`time.time_ns()`)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, AttrValue] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """The stage's duration in seconds (0.0 for a stage that ended before it began: clocks of two threads)."""
        return max(0, self.end_ns - self.start_ns) / 1e9


class Tracing:
    """A process's tracer, or none. ``provider``: an SDK `TracerProvider` with its span processors (None: off).

    The object is shared by every request of the process; it holds no per-request state.
    """

    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider
        self.tracer: Tracer | None = None if provider is None else provider.get_tracer(INSTRUMENTATION)
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def off(cls) -> Tracing:
        """No tracing: `tracer` is None and every method is a no-op."""
        return cls(None)

    @classmethod
    def to_endpoint(cls, endpoint: str | None, *, service: str, instance: str) -> Tracing:
        """Spans exported in batches (every `EXPORT_INTERVAL_S`) over OTLP/HTTP (protobuf) to ``endpoint``
        (e.g. ``http://collector:4318/v1/traces``), as ``service.name`` = ``service`` and
        ``service.instance.id`` = ``instance``. ``endpoint`` None: `off`."""
        if endpoint is None:
            return cls.off()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=Resource.create({"service.name": service, "service.instance.id": instance}),
                                  shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S),
            schedule_delay_millis=EXPORT_INTERVAL_S * 1000, export_timeout_millis=EXPORT_TIMEOUT_S * 1000))
        log.info("%s: exporting request traces over OTLP/HTTP to %s", instance, endpoint)
        return cls(provider)

    # ------------------------------------------------------------ propagation
    def parent_from(self, headers: Mapping[str, str]) -> Context | None:
        """The caller's span from a W3C ``traceparent`` header, as a parent context; None when off or when
        the header is absent or malformed (the request then starts a trace of its own)."""
        if self.tracer is None or TRACEPARENT not in headers:
            return None
        ctx = self._propagator.extract({TRACEPARENT: headers[TRACEPARENT]}, context=Context())
        return ctx or None

    def parent_from_client(self, headers: Mapping[str, str]) -> Context | None:
        """As `parent_from`, for a request from outside (the router's API): the client's trace id and span stay
        the parent, so its trace joins the client's, but its sampled flag does not bind. A ``traceparent``
        ending ``-00`` would otherwise switch tracing off for the request on every hop (the SDK's default
        sampler, ParentBased, follows the parent's flag), letting any client hide its requests from the
        operator's traces. Nodes keep `parent_from`: their caller is the router, whose decision they follow."""
        ctx = self.parent_from(headers)
        if ctx is None:
            return None
        caller = get_current_span(ctx).get_span_context()
        if caller.trace_flags.sampled:
            return ctx
        sampled = SpanContext(caller.trace_id, caller.span_id, is_remote=True,
                              trace_flags=TraceFlags(caller.trace_flags | TraceFlags.SAMPLED),
                              trace_state=caller.trace_state)
        return set_span_in_context(NonRecordingSpan(sampled), Context())

    def headers_for(self, span: Span | None) -> dict[str, str]:
        """``{"traceparent": ...}`` naming ``span`` as the parent of the callee's spans; {} when off or None."""
        if self.tracer is None or span is None:
            return {}
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span, Context()))
        return carrier

    # ------------------------------------------------------------------ spans
    def start(self, name: str, *, parent: Parent, start_ns: int, attributes: Mapping[str, AttrValue] | None = None,
              kind: SpanKind = SpanKind.INTERNAL) -> Span | None:
        """An open span (end it with ``span.end(end_time=ns)``); a root span when ``parent`` is None. None when off."""
        if self.tracer is None:
            return None
        try:
            return self.tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes,
                                          start_time=start_ns)
        except Exception:  # noqa: BLE001 - a span that cannot be made costs the trace, never the request
            log.exception("starting the %s span failed", name)
            return None

    def record(self, stage: Stage, *, parent: Parent, children: Sequence[Stage] = (),
               kind: SpanKind = SpanKind.INTERNAL, error: str | None = None) -> Span | None:
        """``stage`` as an ended span under ``parent`` (a root when None), and each of ``children`` as an ended span
        under it; ``error`` marks the stage's span failed with that description. Returns the stage's span; None
        when off."""
        tracer = self.tracer
        if tracer is None:
            return None
        try:
            span = tracer.start_span(stage.name, context=_context(parent), kind=kind, attributes=stage.attributes,
                                     start_time=stage.start_ns)
            ctx = set_span_in_context(span, Context())
            for child in children:
                tracer.start_span(child.name, context=ctx, attributes=child.attributes,
                                  start_time=child.start_ns).end(end_time=child.end_ns)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error[:500]))
            span.end(end_time=stage.end_ns)
        except Exception:  # noqa: BLE001 - a span that cannot be made costs the trace, never the request
            log.exception("recording the %s span failed", stage.name)
            return None
        return span

    async def aclose(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flush the spans still queued and stop exporting, within ``timeout_s`` (then give the rest up). For an
        app's cleanup; a no-op when off."""
        provider = self.provider
        if provider is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(provider.shutdown), timeout_s)
        except Exception as exc:  # noqa: BLE001 - a collector that is gone must not fail the stop
            log.warning("flushing request traces failed (%r); spans not yet exported are lost", exc)


def _context(parent: Parent) -> Context:
    """``parent`` as an explicit context; an empty one (a new trace) for None, never the ambient context."""
    if parent is None:
        return Context()
    if isinstance(parent, Context):
        return parent
    return set_span_in_context(parent, Context())
