"""`RequestTrace`: one API request's stage timings and, with tracing on, its trace (`node.tracing`).

The span tree of one request (router spans here; node spans join through the W3C ``traceparent`` header the
router sends on each internal call)::

    kvrelay.request              router    arrival → last byte (child of the client's traceparent, if sent)
    ├── router.queue             router    admitted → placed (waiting for room; the placement ends it)
    ├── router.dispatch          router    placed → first token at the router; plan and nodes as attributes
    │   └── prefill.request      prefill   POST /prefill        (a disaggregated plan)
    │       ├── prefill.queue / prefill.compute / prefill.publish
    └── router.decode            router    the decode call(s) → last token
        └── decode.request       decode    POST /generate
            ├── decode.kv_pull / decode.queue / decode.first_step / decode.stream

A disaggregated request's first token comes from the prefill node: its KV pull, decode queue and first decode
step come after its TTFT (they delay its second token). Under a local plan (no prefill node) ``router.dispatch``
ends at the decode node's first frame: its ``decode.queue`` and ``decode.first_step`` make up that time.

Timings (seconds; `timings`), collected whether or not tracing is on::

    parse_s          arrival → admitted (body, tokenizing, templating)
    router_queue_s   admitted → placed
    dispatch_s       placed → first token at the router
    prefill_queue_s, prefill_compute_s, publish_s          the prefill node's (within dispatch_s)
    kv_pull_s, decode_queue_s, first_step_s, stream_s      the decode node's
    ttft_s           arrival → first token at the router (= parse_s + router_queue_s + dispatch_s)
    total_s          arrival → when the timings were read (the answer's end)

With several prompts in one request, the stages are those of the first prompt; ``ttft_s`` is the request's.
A request owns its trace: only its handler task and the dispatcher's run of it touch it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from kvrelay.node.tracing import Stage, Tracing
from kvrelay.router.plan import PlanChoice
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

ROUTER_STAGES = ("parse_s", "router_queue_s", "dispatch_s")


class RunTrace:
    """The stages of one generation request (one prompt) through the cluster; the dispatcher reports to it."""

    def __init__(self, tracing: Tracing, root: Span | None, *, request_id: str, admitted_ns: int) -> None:
        self._tracing = tracing
        self._root = root
        self.request_id = request_id
        self.admitted_ns = admitted_ns
        self.timings: dict[str, float] = {}  # node stages and router_queue_s, dispatch_s (seconds)
        self.plan = ""  # "disaggregated" or "local", once placed
        self._placed_ns = 0
        self._dispatch: Span | None = None  # open from placement to the first token
        self._decode: Span | None = None  # open from the first decode call to the end

    @classmethod
    def untraced(cls, request_id: str = "") -> RunTrace:
        """Timings only (a dispatcher called without a trace)."""
        return cls(Tracing.off(), None, request_id=request_id, admitted_ns=time.time_ns())

    def placed(self, choice: PlanChoice | None, *, prefill: str | None, decode: str) -> None:
        """The request got its room: ``prefill`` (None: a local plan) and ``decode`` are its nodes."""
        now = self._placed_ns = time.time_ns()
        self.plan = choice.plan if choice is not None else "disaggregated" if prefill is not None else "local"
        self.timings["router_queue_s"] = (now - self.admitted_ns) / 1e9
        tracing = self._tracing
        if tracing.tracer is None:
            return
        tracing.record(Stage("router.queue", self.admitted_ns, now, {"request_id": self.request_id}),
                       parent=self._root)
        attrs: dict[str, str | float] = {"request_id": self.request_id, "plan": self.plan, "decode_node": decode}
        if prefill is not None:
            attrs["prefill_node"] = prefill
        if choice is not None:
            attrs.update(predicted_ttft_s=choice.predicted_ttft_s, model_ttft_s=choice.model_ttft_s)
        self._dispatch = tracing.start("router.dispatch", parent=self._root, start_ns=now, attributes=attrs)

    def prefill_headers(self) -> dict[str, str]:
        """The ``traceparent`` of a call to a prefill node: under ``router.dispatch`` while it is open (a
        fresh prefill for a request moving mid-stream goes under ``router.decode``)."""
        return self._tracing.headers_for(self._dispatch or self._decode)

    def decode_headers(self) -> dict[str, str]:
        """The ``traceparent`` of a call to a decode node (``router.decode``, opened by the first call)."""
        tracing = self._tracing
        if tracing.tracer is None:
            return {}
        if self._decode is None:
            self._decode = tracing.start("router.decode", parent=self._root, start_ns=time.time_ns(),
                                         attributes={"request_id": self.request_id})
        return tracing.headers_for(self._decode)

    def node_timings(self, timings: Mapping[str, float] | None) -> None:
        """A node's stage timings (a prefill reply's, a decode frame's); the first value of each stage stands
        (a fresh prefill or decode node taking over mid-stream does not replace them)."""
        if timings:
            for name, seconds in timings.items():
                if name == "stream_s" or name not in self.timings:
                    self.timings[name] = seconds

    def first_token(self) -> None:
        """The request's first token reached the router: dispatch is over."""
        if "dispatch_s" in self.timings or not self._placed_ns:
            return
        now = time.time_ns()
        self.timings["dispatch_s"] = (now - self._placed_ns) / 1e9
        if self._dispatch is not None:
            self._dispatch.end(end_time=now)
            self._dispatch = None

    def end(self, error: str | None = None) -> None:
        """The run is over (``error``: why it failed); its open spans end now."""
        now = time.time_ns()
        for span in (self._dispatch, self._decode):
            if span is not None:
                if error is not None:
                    span.set_status(Status(StatusCode.ERROR, error[:500]))
                span.end(end_time=now)
        self._dispatch = self._decode = None


class RequestTrace:
    """One API request: its root span (tracing on), its runs (`RunTrace`, one per prompt) and its timings.
    ``headers``: the client's request headers (a ``traceparent`` makes the root span its child; its sampled flag
    does not turn tracing off: `node.tracing.Tracing.parent_from_client`)."""

    def __init__(self, tracing: Tracing, headers: Mapping[str, str], *, arrived_ns: int) -> None:
        self._tracing = tracing
        self.arrived_ns = arrived_ns
        self.root = tracing.start("kvrelay.request", parent=tracing.parent_from_client(headers), start_ns=arrived_ns,
                                  kind=SpanKind.SERVER)
        self.runs: list[RunTrace] = []
        self.num_tokens = 0  # output tokens that reached the router's handler, all samples
        self.status = ""  # the answer's status once its last bytes went out ("": not yet)
        self._first_token_ns = 0
        self._parsed_ns = 0

    def admitted(self, request_ids: Sequence[str], *, prompt_tokens: int) -> list[RunTrace]:
        """The request was parsed (``request_ids``: one per prompt) and queued: one `RunTrace` per prompt."""
        now = self._parsed_ns = time.time_ns()
        self.runs = [RunTrace(self._tracing, self.root, request_id=rid, admitted_ns=now) for rid in request_ids]
        if self.root is not None:
            self.root.set_attributes({"request_id": request_ids[0], "prompt_tokens": prompt_tokens})
        return self.runs

    def tokens(self, n: int) -> None:
        """``n`` output tokens reached the router's handler; the first of them is the request's first token."""
        if n and not self._first_token_ns:
            self._first_token_ns = time.time_ns()
        self.num_tokens += n

    def timings(self) -> dict[str, float]:
        """Stage timings in seconds (see the module docstring), as of now."""
        now = time.time_ns()
        out: dict[str, float] = {}
        if self._parsed_ns:
            out["parse_s"] = (self._parsed_ns - self.arrived_ns) / 1e9
        if self.runs:
            out.update(self.runs[0].timings)
        if self._first_token_ns:
            out["ttft_s"] = (self._first_token_ns - self.arrived_ns) / 1e9
        out["total_s"] = (now - self.arrived_ns) / 1e9
        return {k: round(v, 6) for k, v in out.items()}

    @property
    def plan(self) -> str:
        """The first prompt's plan ("disaggregated" or "local"); "" before placement."""
        return self.runs[0].plan if self.runs else ""

    def answer_field(self) -> dict[str, object]:
        """The answer's ``kvrelay`` object when the client asked for timings: ``{"timings": ..., "plan": ...}``."""
        return {"timings": self.timings(), "plan": self.plan}

    def end(self, *, status: str, output_tokens: int = 0) -> None:
        """The answer is complete (``status``: the HTTP status, or how it ended): the root span ends."""
        root = self.root
        if root is None:
            return
        self.root = None
        attrs: dict[str, str | int | float] = {"status": status, "output_tokens": output_tokens}
        if self._first_token_ns:
            attrs["ttft_s"] = (self._first_token_ns - self.arrived_ns) / 1e9
        root.set_attributes(attrs)
        if status != "200":
            root.set_status(Status(StatusCode.ERROR, status))
        root.end(end_time=time.time_ns())
