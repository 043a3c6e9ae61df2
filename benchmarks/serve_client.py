"""Async load generator for any OpenAI-compatible ``/v1/completions`` endpoint (streaming SSE).

One request, as the client sees it (all times from one monotonic clock, seconds)::

    send ─────── chunk_0 ── chunk_1 ── … ── chunk_k          (chunks = SSE events carrying ``choices``)
         └ ttft ─┘└ itl_0 ┘                                 latency = chunk_k − send
                                                            output_tokens = usage.completion_tokens

These are the definitions of ``vllm bench serve``: the first chunk with ``choices`` is the first token
(even if its text is empty, e.g. half a UTF-8 character), every later such chunk adds one inter-token
latency, and the end of the request is its last ``choices`` chunk. Output tokens are counted from the
``usage`` chunk (``stream_options.include_usage``), so chunks that bundle several tokens do not skew TPOT.

Arrivals: Poisson at ``request_rate`` (seeded, normalised so n requests span n / rate seconds), all at once
for ``inf``, or the requests' own ``arrival_s`` (trace replay). ``max_concurrency`` caps requests in
flight. A workload may return a follow-up request when one finishes (multi-round chat); it is sent at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send. ``arrival_s``: offset from the start of the run (None: the load sets it).

    ``conversation`` and ``turn`` identify multi-round requests (a follow-up keeps its conversation).
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float | None = None
    conversation: int = 0
    turn: int = 0


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Times are clock readings in seconds.

    ``chunk_times_s``: arrival of every SSE event with ``choices``. ``output_tokens``: from ``usage``
    (None when the server sent none; `num_output_tokens` then counts chunks). ``response_id``: the ``id`` of the
    first event that carried one (the server's request id, which its logs name; "" if none did). ``server``: the
    ``kvrelay`` field of the last event that carried one (the plan and stage timings a kvrelay router sends when
    the request asks, `ClientConfig.extra_body`); empty if none did.
    """

    spec: RequestSpec
    send_time_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    generated_text: str = ""
    success: bool = False
    error: str = ""
    response_id: str = ""
    server: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.send_time_s if self.chunk_times_s else 0.0

    @property
    def latency_s(self) -> float:
        return self.chunk_times_s[-1] - self.send_time_s if self.chunk_times_s else 0.0

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times_s)


def feed_sse_line(record: RequestRecord, line: str, now_s: float) -> bool:
    """Apply one line of an SSE stream to ``record``; returns True at ``data: [DONE]``.

    Mutates ``record``: appends to ``chunk_times_s`` and ``generated_text``, sets ``output_tokens``.
    Blank lines, comments and non-``data`` fields are ignored.

    Raises:
        ValueError: a ``data`` payload that is not JSON, or an ``error`` object from the server.
    """
    line = line.strip()
    if not line.startswith("data:"):
        return False
    payload = line[5:].strip()
    if payload == "[DONE]":
        return True
    data = json.loads(payload)
    if "error" in data:
        raise ValueError(f"server error in stream: {data['error']}")
    if not record.response_id and isinstance(data.get("id"), str):
        record.response_id = data["id"]
    if isinstance(data.get("kvrelay"), dict):
        record.server = data["kvrelay"]
    if choices := data.get("choices"):
        record.chunk_times_s.append(now_s)
        record.generated_text += choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
    if usage := data.get("usage"):
        record.output_tokens = int(usage.get("completion_tokens", 0))
    return False


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where and how to send. ``url`` is the server root (``http://host:port``, no ``/v1``)."""

    url: str
    model: str
    timeout_s: float = 300.0
    api_key: str | None = None
    ignore_eos: bool = True
    extra_body: Mapping[str, Any] | None = None  # fields added to every request's body (e.g. ``{"kvrelay": ...}``)


async def send_request(session: aiohttp.ClientSession, config: ClientConfig, spec: RequestSpec, *,
                       clock: Clock = time.perf_counter) -> RequestRecord:
    """POST one streaming greedy completion (prompt as token ids); never raises for server or network
    failures: they end as ``success=False`` with ``error`` set. ``timeout_s`` bounds the whole request."""
    body = {
        "model": config.model, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": config.ignore_eos, **(config.extra_body or {}),
    }
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    record = RequestRecord(spec)
    record.send_time_s = clock()
    try:
        async with session.post(config.url + "/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=config.timeout_s)) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return record
            done = False
            async for raw in resp.content:
                if feed_sse_line(record, raw.decode("utf-8", "replace"), clock()):
                    done = True
            if not record.chunk_times_s:
                record.error = "stream ended without a token"
            elif not done:
                record.error = "stream ended without data: [DONE]"
            else:
                record.success = True
    except asyncio.TimeoutError:
        record.error = f"timed out after {config.timeout_s:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def poisson_offsets(n: int, request_rate: float, *, seed: int) -> list[float]:
    """Send offsets (s) of ``n`` requests at ``request_rate`` per second: exponential gaps from a
    ``seed``-ed generator, rescaled so the last lands at ``n / request_rate`` (as vLLM does, so runs
    with different seeds offer the same load). ``inf``: all zero.

    Raises:
        ValueError: ``request_rate`` is not positive.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive or inf, got {request_rate}")
    if math.isinf(request_rate) or n == 0:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    offsets = np.cumsum(gaps)
    offsets *= (n / request_rate) / offsets[-1]
    return [float(x) for x in offsets]


FollowUp = Callable[[RequestSpec, RequestRecord], "RequestSpec | None"]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to offer the load. ``max_concurrency`` None: unbounded."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    progress: bool = True


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Records in send order, and the wall time from the first scheduled send to the last completion."""

    records: list[RequestRecord]
    duration_s: float


async def run_load(client: ClientConfig, requests: Sequence[RequestSpec], load: LoadConfig, *,
                   follow_up: FollowUp | None = None, expected_total: int | None = None,
                   clock: Clock = time.perf_counter) -> LoadResult:
    """Send ``requests`` (plus any follow-ups) and wait for all of them.

    Requests with ``arrival_s`` set keep it; the rest get Poisson offsets from ``load``. Follow-ups are
    sent as soon as their predecessor finishes (successfully: a failed turn ends its conversation).
    """
    specs = list(requests)
    offsets = poisson_offsets(len(specs), load.request_rate, seed=load.seed)
    timed = [(s.arrival_s if s.arrival_s is not None else off, s) for s, off in zip(specs, offsets)]
    timed.sort(key=lambda pair: pair[0])
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    records: list[RequestRecord] = []
    bar = tqdm(total=expected_total or len(specs), disable=not load.progress, desc="requests", leave=False)
    connector = aiohttp.TCPConnector(limit=load.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks: set[asyncio.Task] = set()

        async def one(spec: RequestSpec) -> None:
            if limit is not None:
                async with limit:
                    record = await send_request(session, client, spec, clock=clock)
            else:
                record = await send_request(session, client, spec, clock=clock)
            records.append(record)
            bar.update(1)
            nxt = follow_up(spec, record) if follow_up is not None and record.success else None
            if nxt is not None:
                await one(nxt)

        start = clock()
        for offset, spec in timed:
            delay = start + offset - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(spec))
            tasks.add(task)
        await asyncio.gather(*tasks)
        duration = clock() - start
    bar.close()
    records.sort(key=lambda r: r.send_time_s)
    return LoadResult(records, duration)
