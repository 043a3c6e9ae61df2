"""Request traces over a real 1P1D deployment (issue 34): the router and both nodes export over OTLP/HTTP to a
receiver in this process, which parses the protobuf; the ``kvrelay.timings`` answer field with and without it."""

from __future__ import annotations

import http.client
import json
import random
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import openai
import pytest
from kvrelay.benchmarks.otlp_receiver import OtlpReceiver, ReceivedSpan
from kvrelay.engine.engine import LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.tiny import write_tiny_model

from tests.services.cluster import Cluster

PROMPT_TOKENS = 1200  # 75 full blocks, of a model wide enough that prefill compute dominates the TTFT
NUM_BLOCKS = PROMPT_TOKENS // 16
PARENT = {  # span -> its parent, in every request's trace (a disaggregated plan)
    "router.queue": "kvrelay.request", "router.dispatch": "kvrelay.request", "router.decode": "kvrelay.request",
    "prefill.request": "router.dispatch", "prefill.queue": "prefill.request", "prefill.compute": "prefill.request",
    "prefill.publish": "prefill.request", "decode.request": "router.decode", "decode.kv_pull": "decode.request",
    "decode.queue": "decode.request", "decode.first_step": "decode.request", "decode.stream": "decode.request",
}
SERVICE = {"kvrelay": "kvrelay-router", "router": "kvrelay-router", "prefill": "kvrelay-prefill",
           "decode": "kvrelay-decode"}
TIMING_OF_SPAN = {"router.queue": "router_queue_s", "router.dispatch": "dispatch_s", "prefill.queue": "prefill_queue_s",
                  "prefill.compute": "prefill_compute_s", "prefill.publish": "publish_s", "decode.kv_pull": "kv_pull_s",
                  "decode.queue": "decode_queue_s", "decode.first_step": "first_step_s", "decode.stream": "stream_s"}


def _stream(url: str, prompt: list[int], *, timings: bool,
            headers: dict[str, str] | None = None) -> tuple[float, list[dict[str, Any]]]:
    """Stream a completion over a fresh connection; the client's TTFT (seconds from sending the request to the
    first chunk of a choice: its first token, whose text may still be empty, a byte of an unfinished UTF-8
    character) and every chunk. A plain HTTP client: the official one adds ~20 ms of its own here."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
    if timings:
        body["kvrelay"] = {"timings": True}
    data = json.dumps(body).encode()
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json",
                                                                    **(headers or {})})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        ttft, chunks = 0.0, []
        while (line := resp.readline()) and not line.startswith(b"data: [DONE]"):
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
                if not ttft and chunks[-1]["choices"]:
                    ttft = time.perf_counter() - t0
        return ttft, chunks
    finally:
        conn.close()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PROMPT_TOKENS)]


def _check_timings(timings: dict[str, float], client_ttft: float) -> None:
    """The stage timings of one disaggregated request against the TTFT its client measured."""
    assert set(timings) == {"parse_s", "router_queue_s", "dispatch_s", "prefill_queue_s", "prefill_compute_s",
                            "publish_s", "kv_pull_s", "decode_queue_s", "first_step_s", "stream_s", "ttft_s",
                            "total_s"}
    before_first = timings["parse_s"] + timings["router_queue_s"] + timings["dispatch_s"]
    assert before_first <= timings["ttft_s"] <= client_ttft
    assert 0.9 * client_ttft <= before_first
    node = timings["prefill_queue_s"] + timings["prefill_compute_s"] + timings["publish_s"]
    assert node <= timings["dispatch_s"]
    assert 0.9 * client_ttft <= timings["parse_s"] + timings["router_queue_s"] + node <= client_ttft


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model 6 layers deep and 512 wide: a 1200-token prompt takes long enough to prefill (~0.5 s here)
    that the fixed costs outside the stages (HTTP hops, JSON, SSE: ~20 ms on 2 busy cores) stay a small part of
    the TTFT. (4 x 256 took ~0.15 s, and the hops alone came to 12% of it under load.)"""
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "model", layers=6, hidden=512)


def test_one_trace_per_request_across_router_prefill_and_decode(wide_model_dir):
    block_bytes = LLMEngine.block_spec_for(load_model(wide_model_dir), 16).block_bytes
    with OtlpReceiver() as rx, Cluster(wide_model_dir, overrides={
            "observability": {"otlp_endpoint": rx.url}, "kvstore": {"integrity": "all"}}) as c:
        _stream(c.url, _prompt(0)[:40], timings=False)  # warm: the first steps, the NIXL handshake
        rx.wait_for(lambda spans: len(spans) == len(PARENT) + 1, timeout_s=30)
        rx.clear()
        trace_ids = [f"{k + 1:032x}" for k in range(2)]
        measured = []
        for k, trace_id in enumerate(trace_ids):
            ttft, chunks = _stream(c.url, _prompt(k + 1), timings=True,
                                   headers={"traceparent": f"00-{trace_id}-{k + 1:016x}-01"})
            measured.append((ttft, chunks[-1]["kvrelay"]["timings"]))
        spans = rx.wait_for(lambda spans: len(spans) == 2 * (len(PARENT) + 1), timeout_s=30)
    assert sorted({s.trace_id for s in spans}) == trace_ids  # one trace per request: the client's
    for k, (trace_id, (client_ttft, timings)) in enumerate(zip(trace_ids, measured, strict=True)):
        mine = [s for s in spans if s.trace_id == trace_id]
        by_name: dict[str, ReceivedSpan] = {s.name: s for s in mine}
        assert sorted(by_name) == sorted(["kvrelay.request", *PARENT]) and len(mine) == len(by_name)
        root = by_name["kvrelay.request"]
        assert root.parent_id == f"{k + 1:016x}"  # the client's span
        for name, parent in PARENT.items():
            assert by_name[name].parent_id == by_name[parent].span_id, name
        for s in mine:
            assert s.service == SERVICE[s.name.split(".")[0]] and not s.error
            assert s.start_ns <= s.end_ns
        pull = by_name["decode.kv_pull"].attributes
        assert pull == {"blocks": NUM_BLOCKS, "blocks_read": NUM_BLOCKS, "blocks_held": 0,
                        "bytes": NUM_BLOCKS * block_bytes, "tier": "device", "integrity_checked": NUM_BLOCKS,
                        "integrity_failed": 0}
        assert by_name["prefill.publish"].attributes == {"blocks": NUM_BLOCKS}
        assert by_name["router.dispatch"].attributes["plan"] == "disaggregated"
        assert root.attributes["prompt_tokens"] == PROMPT_TOKENS and root.attributes["output_tokens"] == 6
        # the timings the client got are the spans' durations
        for name, timing in TIMING_OF_SPAN.items():
            assert abs(by_name[name].seconds - timings[timing]) < 2e-6, name
        # the stages before the first token sum to within 10% of the client's TTFT, and never past it
        first_token = sum(by_name[n].seconds for n in ("router.queue", "prefill.queue", "prefill.compute",
                                                         "prefill.publish"))
        assert 0.9 * client_ttft <= first_token <= client_ttft, (first_token, client_ttft, timings,
                                                                 {s.name: s.seconds for s in mine})
        _check_timings(timings, client_ttft)
        # the decode node's stages come after the first token (they delay the second), inside its request
        decode = by_name["decode.request"]
        assert sum(by_name[n].seconds for n in ("decode.kv_pull", "decode.queue", "decode.first_step",
                                                "decode.stream")) <= decode.seconds
        assert by_name["router.dispatch"].end_ns <= by_name["decode.first_step"].end_ns


def test_timings_without_an_exporter(wide_model_dir):
    with Cluster(wide_model_dir) as c:
        _stream(c.url, _prompt(0)[:40], timings=False)
        ttft, chunks = _stream(c.url, _prompt(1), timings=True)
        assert chunks[-1]["choices"] == [] and chunks[-1]["kvrelay"]["plan"] == "disaggregated"
        _check_timings(chunks[-1]["kvrelay"]["timings"], ttft)
        _, plain = _stream(c.url, _prompt(2), timings=False)
        assert len(plain) == 6 and all("kvrelay" not in chunk for chunk in plain)
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0)  # the official client sees it
        streamed = list(client.completions.create(model="tiny", prompt=_prompt(3), max_tokens=6, temperature=0,
                                                  stream=True, extra_body={"kvrelay": {"timings": True}}))
        assert streamed[-1].choices == [] and streamed[-1].model_extra["kvrelay"]["timings"]["ttft_s"] > 0
        full = client.completions.create(model="tiny", prompt=_prompt(3), max_tokens=6, temperature=0,
                                         extra_body={"kvrelay": {"timings": True}})
        timings = full.model_extra["kvrelay"]["timings"]
        assert timings["parse_s"] + timings["router_queue_s"] + timings["dispatch_s"] <= timings["ttft_s"]
        assert timings["kv_pull_s"] > 0 and timings["stream_s"] > 0
