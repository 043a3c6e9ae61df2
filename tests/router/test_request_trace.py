"""Request traces and timings in the router (`router.request_trace`, `node.tracing`): an in-process router with an
in-memory span exporter, against fake prefill and decode nodes that record the ``traceparent`` they receive."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from kvrelay.node.tracing import Stage, Tracing
from kvrelay.router.app import Router
from kvrelay.router.config import RouterConfig
from kvrelay.router.request_trace import RequestTrace
from kvrelay.transfer.wire import DecodeFrame, PrefillReply, encode_frame, encode_prefill_reply, pack
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

PREFILL_TIMINGS = {"prefill_queue_s": 0.001, "prefill_compute_s": 0.02, "publish_s": 0.0005}
DECODE_FIRST = {"kv_pull_s": 0.0, "decode_queue_s": 0.002, "first_step_s": 0.003}
DECODE_LAST = {**DECODE_FIRST, "stream_s": 0.004}
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


async def _fake_node(role: str, seen: list[dict[str, str]]) -> TestServer:
    """A node of ``role`` that answers /info and /kv/events, and records the headers of each /prefill or
    /generate call in ``seen``: prefill answers first token 7 (no KV handle), decode streams 8 then 9."""

    async def info(request: web.Request) -> web.Response:
        return web.Response(body=pack({"role": role, "node": f"{role}-0", "model": "tiny", "vocab_size": 258,
                                       "max_model_len": 2048, "block_size_tokens": 16, "spec_fingerprint": b"f" * 8,
                                       "eos_token_ids": [257]}), content_type="application/msgpack")

    async def events(request: web.Request) -> web.Response:
        await asyncio.sleep(min(float(request.query.get("wait_s", "0")), 0.2))
        return web.Response(body=pack({"node": f"{role}-0", "last_seq": 0, "events": [], "snapshot": None, "load": {
            "kv_blocks": 100, "free_blocks": 100, "max_num_seqs": 8, "max_num_batched_tokens": 512,
            "prefill_tokens_per_s": 0.0, "decode_step_s": 0.0}}), content_type="application/msgpack")

    async def prefill(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.Response(body=encode_prefill_reply(PrefillReply([7], [None], None, 0, timings=PREFILL_TIMINGS)),
                            content_type="application/msgpack")

    async def generate(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        resp = web.StreamResponse(headers={"Content-Type": "application/msgpack"})
        await resp.prepare(request)
        await resp.write(encode_frame(DecodeFrame(0, [8], False, None, timings=DECODE_FIRST)))
        await resp.write(encode_frame(DecodeFrame(0, [9], True, "length", timings=DECODE_LAST)))
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/info", info)
    app.router.add_get("/kv/events", events)
    app.router.add_post("/prefill", prefill)
    app.router.add_post("/generate", generate)
    server = TestServer(app)
    await server.start_server()
    return server


async def _serve(model_dir: Path, tracing: Tracing, bodies: list[tuple[dict[str, Any], dict[str, str]]]
                 ) -> tuple[list[Any], list[dict[str, str]], list[dict[str, str]]]:
    """Each (body, headers) posted to /v1/completions of a router over one fake prefill and one fake decode node:
    the answers (JSON, or the SSE events' JSON for a stream), and the headers each node received."""
    prefill_seen: list[dict[str, str]] = []
    decode_seen: list[dict[str, str]] = []
    p, d = await _fake_node("prefill", prefill_seen), await _fake_node("decode", decode_seen)
    router = Router(RouterConfig(model_name="tiny", model_dir=str(model_dir), prefill_urls=(str(p.make_url("")),),
                                 decode_urls=(str(d.make_url("")),), disaggregation="always"), tracing=tracing)
    server = TestServer(router.make_app())
    await server.start_server()
    answers: list[Any] = []
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):  # until both nodes' load reports are in
                async with session.get(server.make_url("/health")) as resp:
                    if resp.status == 200 and all(n["capacity"] for n in (await resp.json())["nodes"].values()):
                        break
                await asyncio.sleep(0.05)
            for body, headers in bodies:
                async with session.post(server.make_url("/v1/completions"), json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    if body.get("stream"):
                        text = await resp.text()
                        answers.append([json.loads(line[6:]) for line in text.splitlines()
                                        if line.startswith("data: {")])
                    else:
                        answers.append(await resp.json())
    finally:
        await server.close()
        await p.close()
        await d.close()
    return answers, prefill_seen, decode_seen


def _in_memory() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}


def test_router_spans_nest_and_traceparent_reaches_each_node(tiny_model_dir):
    tracing, exporter = _in_memory()
    client = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
    answers, prefill_seen, decode_seen = asyncio.run(_serve(tiny_model_dir, tracing, [(BODY, client), (BODY, {})]))
    assert [a["choices"][0]["text"] for a in answers] == ["\x07\x08\t"] * 2
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == sorted(["kvrelay.request", "router.queue", "router.dispatch",
                                                    "router.decode"] * 2)
    traces = {s.context.trace_id for s in spans}
    assert len(traces) == 2  # one trace per request
    by_name = {(s.context.trace_id, s.name): s for s in spans}
    for trace_id in traces:
        root = by_name[trace_id, "kvrelay.request"]
        for name in ("router.queue", "router.dispatch", "router.decode"):
            assert by_name[trace_id, name].parent.span_id == root.context.span_id
        dispatch, decode = by_name[trace_id, "router.dispatch"], by_name[trace_id, "router.decode"]
        assert dispatch.attributes["plan"] == "disaggregated"
        assert dispatch.attributes["prefill_node"] == "prefill-0" and dispatch.attributes["decode_node"] == "decode-0"
        assert root.attributes["output_tokens"] == 3 and root.attributes["status"] == "200"
        assert root.start_time <= dispatch.start_time <= dispatch.end_time <= decode.end_time <= root.end_time
    # the client's traceparent makes the first request's root its child, in the client's trace
    first = int(CLIENT_TRACE_ID, 16)
    assert first in traces
    assert by_name[first, "kvrelay.request"].parent.span_id == int(CLIENT_SPAN_ID, 16)
    assert by_name[first, "kvrelay.request"].parent.is_remote
    assert [s for s in spans if s.name == "kvrelay.request" and s.context.trace_id != first][0].parent is None
    # each node call named the router's span it runs under: prefill under dispatch, decode under router.decode
    [second] = traces - {first}
    for k, trace_id in enumerate((first, second)):
        dispatch_id, decode_id = (by_name[trace_id, n].context.span_id for n in ("router.dispatch", "router.decode"))
        assert prefill_seen[k]["traceparent"][:52] == f"00-{trace_id:032x}-{dispatch_id:016x}"
        assert decode_seen[k]["traceparent"][:52] == f"00-{trace_id:032x}-{decode_id:016x}"


def test_a_client_traceparent_that_is_not_sampled_does_not_turn_tracing_off(tiny_model_dir):
    """The router traces its own requests: a client's flag 00 keeps the client's trace id and parent span, but
    the request is still recorded, and the nodes are told to record theirs (flag 01)."""
    tracing, exporter = _in_memory()
    client = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00"}
    answers, prefill_seen, decode_seen = asyncio.run(_serve(tiny_model_dir, tracing, [(BODY, client)]))
    assert answers[0]["choices"][0]["text"] == "\x07\x08\t"
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == ["kvrelay.request", "router.decode", "router.dispatch", "router.queue"]
    assert {s.context.trace_id for s in spans} == {int(CLIENT_TRACE_ID, 16)}
    [root] = [s for s in spans if s.name == "kvrelay.request"]
    assert root.parent.span_id == int(CLIENT_SPAN_ID, 16) and root.context.trace_flags.sampled
    dispatch_id, decode_id = (next(s for s in spans if s.name == n).context.span_id
                              for n in ("router.dispatch", "router.decode"))
    assert prefill_seen[0]["traceparent"] == f"00-{CLIENT_TRACE_ID}-{dispatch_id:016x}-01"
    assert decode_seen[0]["traceparent"] == f"00-{CLIENT_TRACE_ID}-{decode_id:016x}-01"


def test_timings_come_back_when_asked_and_only_then(tiny_model_dir):
    asked = {**BODY, "kvrelay": {"timings": True}}
    bodies = [(asked, {}), ({**asked, "stream": True}, {}),
              ({**asked, "stream": True, "stream_options": {"include_usage": True}}, {}), (BODY, {}),
              ({**BODY, "stream": True}, {})]
    answers, prefill_seen, decode_seen = asyncio.run(_serve(tiny_model_dir, Tracing.off(), bodies))
    full, stream, with_usage, plain, plain_stream = answers
    stages = {**PREFILL_TIMINGS, **DECODE_LAST}
    for timings in (full["kvrelay"]["timings"], stream[-1]["kvrelay"]["timings"],
                    with_usage[-1]["kvrelay"]["timings"]):
        assert set(timings) == {"parse_s", "router_queue_s", "dispatch_s", "ttft_s", "total_s", *stages}
        assert {k: timings[k] for k in stages} == stages  # the nodes' own, as they sent them
        # the router's stages partition the time to the first token
        router_sum = timings["parse_s"] + timings["router_queue_s"] + timings["dispatch_s"]
        assert router_sum <= timings["ttft_s"] <= router_sum + 0.002
        assert timings["ttft_s"] <= timings["total_s"]
    assert full["kvrelay"]["plan"] == stream[-1]["kvrelay"]["plan"] == "disaggregated"
    assert stream[-1]["choices"] == [] and "usage" not in stream[-1]  # a chunk of its own
    assert with_usage[-1]["usage"]["completion_tokens"] == 3 and with_usage[-1]["choices"] == []
    assert "kvrelay" not in plain and all("kvrelay" not in chunk for chunk in plain_stream)
    # tracing off: no traceparent on any internal call
    assert len(prefill_seen) == len(decode_seen) == 5
    assert not any("traceparent" in h for h in prefill_seen + decode_seen)


def test_timings_field_is_validated(tiny_model_dir):
    from kvrelay.model.tokenizer import load_tokenizer
    from kvrelay.router.openai_api import ApiError, ServedModel, parse_completion

    served = ServedModel("tiny", 258, 2048, 4, load_tokenizer(tiny_model_dir))
    assert parse_completion({**BODY, "kvrelay": {"timings": True}}, served).timings is True
    assert parse_completion(BODY, served).timings is False
    for ext, message in (({"timings": "yes"}, "kvrelay.timings must be true or false, got str"),
                         ({"timing": True}, "kvrelay: unknown field 'timing'; the extension takes long_context "
                                            "and timings")):
        try:
            parse_completion({**BODY, "kvrelay": ext}, served)
        except ApiError as exc:
            assert exc.status == 400 and exc.message == message
        else:
            raise AssertionError("accepted")


def test_no_tracer_records_nothing():
    off = Tracing.off()
    assert off.tracer is None and off.provider is None
    assert off.parent_from({"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}) is None
    assert off.headers_for(None) == {}
    assert off.record(Stage("x", 1, 2), parent=None) is None and off.start("x", parent=None, start_ns=1) is None
    trace = RequestTrace(off, {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}, arrived_ns=1)
    assert trace.root is None
    [run] = trace.admitted(["r1"], prompt_tokens=3)
    run.placed(None, prefill="p", decode="d")
    assert run.prefill_headers() == {} and run.decode_headers() == {}
    assert run._dispatch is None and run._decode is None  # no span objects
    run.first_token()
    assert set(trace.timings()) == {"parse_s", "router_queue_s", "dispatch_s", "total_s"}


def test_node_stages_nest_under_the_callers_span():
    tracing, exporter = _in_memory()
    parent = tracing.start("router.dispatch", parent=None, start_ns=1_000)
    headers = tracing.headers_for(parent)
    assert headers["traceparent"].startswith(f"00-{parent.get_span_context().trace_id:032x}-")
    node_side = Tracing(tracing.provider)
    span = node_side.record(Stage("prefill.request", 2_000, 9_000, {"request_id": "r"}),
                            parent=node_side.parent_from(headers),
                            children=[Stage("prefill.queue", 2_000, 3_000), Stage("prefill.compute", 3_000, 8_000)])
    parent.end(end_time=10_000)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert span is not None and set(spans) == {"router.dispatch", "prefill.request", "prefill.queue",
                                               "prefill.compute"}
    assert spans["prefill.request"].parent.span_id == spans["router.dispatch"].context.span_id
    assert spans["prefill.queue"].parent.span_id == spans["prefill.request"].context.span_id
    assert (spans["prefill.compute"].start_time, spans["prefill.compute"].end_time) == (3_000, 8_000)
    assert Stage("x", 3_000, 8_000).seconds == 5e-6 and Stage("x", 5, 4).seconds == 0.0
    assert node_side.parent_from({"traceparent": "garbage"}) is None
