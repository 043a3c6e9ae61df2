"""`benchmarks.serve_client`: SSE parsing on a recorded stream with a fake clock, arrival schedules, and the
load generator against a real aiohttp server on loopback that streams scripted chunks."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from aiohttp import web
from kvrelay.benchmarks.serve_client import (
    ClientConfig,
    LoadConfig,
    RequestRecord,
    RequestSpec,
    feed_sse_line,
    poisson_offsets,
    run_load,
)


def chunk(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


# A recorded kvrelay completion stream (id and other fields trimmed): an empty first text (half a UTF-8
# character), two more tokens, the usage chunk, [DONE].
RECORDED = [
    (0.250, chunk("")), (0.250, ""),
    (0.300, chunk("\ufffd")), (0.300, ""),
    (0.380, chunk("ab")), (0.380, ""),
    (0.390, 'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}'),
    (0.391, ": keep-alive comment"),
    (0.400, "data: [DONE]"),
]


def test_recorded_stream_gives_vllm_timings():
    rec = RequestRecord(RequestSpec((1, 2, 3, 4, 5, 6, 7), 3), send_time_s=0.2)
    done = [feed_sse_line(rec, line, t) for t, line in RECORDED]
    assert done == [False] * (len(RECORDED) - 1) + [True]
    assert rec.chunk_times_s == [0.25, 0.3, 0.38]
    assert rec.ttft_s == pytest.approx(0.05)
    assert rec.itl_s == pytest.approx([0.05, 0.08])
    assert rec.latency_s == pytest.approx(0.18)  # last token, not [DONE]
    assert rec.output_tokens == 3 and rec.num_output_tokens == 3
    assert rec.generated_text == "\ufffdab"
    assert rec.prompt_len == 7


def test_the_first_id_a_stream_sends_is_kept():
    rec = RequestRecord(RequestSpec((1,), 2))
    assert rec.response_id == ""
    feed_sse_line(rec, 'data: {"id": "cmpl-7", "choices": [{"text": "a"}]}', 1.0)
    feed_sse_line(rec, 'data: {"id": "cmpl-8", "choices": [{"text": "b"}]}', 1.1)
    assert rec.response_id == "cmpl-7" and rec.server == {}
    feed_sse_line(rec, 'data: {"id": "cmpl-7", "choices": [], "kvrelay": {"plan": "local", "timings": {}}}', 1.2)
    assert rec.server == {"plan": "local", "timings": {}} and len(rec.chunk_times_s) == 2


def test_chat_deltas_and_server_errors():
    rec = RequestRecord(RequestSpec((1,), 1))
    feed_sse_line(rec, 'data: {"choices": [{"delta": {"content": "hi"}}]}', 1.0)
    assert rec.generated_text == "hi" and rec.output_tokens is None and rec.num_output_tokens == 1
    with pytest.raises(ValueError, match="server error"):
        feed_sse_line(rec, 'data: {"error": {"message": "boom"}}', 2.0)


def test_poisson_offsets_are_seeded_and_normalised():
    a = poisson_offsets(50, 5.0, seed=1)
    assert a == poisson_offsets(50, 5.0, seed=1)
    assert a != poisson_offsets(50, 5.0, seed=2)
    assert a[-1] == pytest.approx(10.0)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert poisson_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        poisson_offsets(3, 0.0, seed=0)


class ScriptedServer:
    """``/v1/completions`` that streams ``max_tokens`` one-character chunks ``gap_s`` apart, then usage."""

    def __init__(self, gap_s: float = 0.02) -> None:
        self.gap_s = gap_s
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["max_tokens"] == 99:
            return web.json_response({"error": {"message": "max_tokens too large"}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.gap_s)
                await resp.write((chunk(chr(97 + i)) + "\n\n").encode())
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            await resp.write(("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n").encode())
        finally:
            self.in_flight -= 1
        return resp


async def serve(server: ScriptedServer, coro_fn):  # noqa: ANN201 - test helper
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        return await coro_fn(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def test_load_against_loopback_server():
    server = ScriptedServer(gap_s=0.02)
    specs = [RequestSpec((i, i + 1), 4) for i in range(6)] + [RequestSpec((9,), 99)]

    async def go(url: str):  # noqa: ANN202
        return await run_load(ClientConfig(url, "m"), specs, LoadConfig(max_concurrency=2, progress=False))

    result = asyncio.run(serve(server, go))
    assert len(result.records) == 7
    ok = [r for r in result.records if r.success]
    assert len(ok) == 6
    failed = next(r for r in result.records if not r.success)
    assert failed.error.startswith("HTTP 400") and "max_tokens too large" in failed.error
    assert server.max_in_flight == 2
    for r in ok:
        assert r.num_output_tokens == 4 and r.generated_text == "abcd"
        assert len(r.chunk_times_s) == 4
        assert r.ttft_s >= 0.02 and all(gap >= 0.01 for gap in r.itl_s)
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["model"] == "m"
    assert sorted(tuple(b["prompt"]) for b in server.bodies) == sorted(s.prompt_token_ids for s in specs)
    assert result.duration_s >= 3 * 4 * 0.02  # 6 requests, 2 at a time, 4 chunks each


def test_follow_ups_and_own_arrival_times():
    server = ScriptedServer(gap_s=0.005)
    first = [RequestSpec((1,), 2, arrival_s=0.0, conversation=0), RequestSpec((2,), 2, arrival_s=0.3, conversation=1)]

    def follow_up(spec: RequestSpec, rec: RequestRecord) -> RequestSpec | None:
        if spec.turn == 2:
            return None
        return RequestSpec(spec.prompt_token_ids + tuple(map(ord, rec.generated_text)), 2,
                           conversation=spec.conversation, turn=spec.turn + 1)

    async def go(url: str):  # noqa: ANN202
        return await run_load(ClientConfig(url, "m"), first, LoadConfig(progress=False), follow_up=follow_up)

    result = asyncio.run(serve(server, go))
    assert len(result.records) == 6
    by_conv = {c: [r for r in result.records if r.spec.conversation == c] for c in (0, 1)}
    assert [r.spec.turn for r in by_conv[0]] == [0, 1, 2]
    assert by_conv[0][2].spec.prompt_token_ids == (1, 97, 98, 97, 98)
    assert by_conv[1][0].send_time_s - by_conv[0][0].send_time_s == pytest.approx(0.3, abs=0.1)


def test_timeout_and_refused_connection_are_recorded_not_raised():
    server = ScriptedServer(gap_s=0.5)

    async def go(url: str):  # noqa: ANN202
        return await run_load(ClientConfig(url, "m", timeout_s=0.2), [RequestSpec((1,), 3)],
                              LoadConfig(progress=False))

    [rec] = asyncio.run(serve(server, go)).records
    assert not rec.success and "timed out" in rec.error

    async def refused() -> RequestRecord:
        res = await run_load(ClientConfig("http://127.0.0.1:9", "m"), [RequestSpec((1,), 1)],
                             LoadConfig(progress=False))
        return res.records[0]

    rec = asyncio.run(refused())
    assert not rec.success and "ClientConnectorError" in rec.error
