"""The router: the client-facing OpenAI-compatible API.

    POST /v1/completions, /v1/chat/completions   (stream: SSE ending with ``data: [DONE]``)
    POST /tokenize, /detokenize
    GET  /v1/models, /version, /health, /metrics
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import importlib.metadata
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from kvrelay.model.generation_config import load_generation_defaults
from kvrelay.model.sampling_params import PromptTokenLogprobs, TokenLogprobs
from kvrelay.model.tokenizer import load_tokenizer, resolve_chat_template
from kvrelay.node.health_access import bare_health, sees_internals
from kvrelay.node.tracing import Tracing
from kvrelay.router.backends import Backends
from kvrelay.router.body_buffer import BodyBuffer, BodyRefused
from kvrelay.router.compile_budget import Claim, CompileBudget, CompileBudgetExceeded
from kvrelay.router.config import RouterConfig
from kvrelay.router.deadline import with_deadline
from kvrelay.router.dispatch import Dispatcher, SampleDelta
from kvrelay.router.harmony import served_encoding
from kvrelay.router.harmony_output import HarmonyStream, parse_tokens
from kvrelay.router.membership import Membership
from kvrelay.router.nodes import NodeSet
from kvrelay.router.openai_api import (
    ApiError,
    GenerationRequest,
    ServedModel,
    parse_chat,
    parse_completions,
    parse_detokenize,
    parse_tokenize,
)
from kvrelay.router.openai_responses import (
    extension_chunk,
    full_response,
    logprobs_body,
    next_text_offset,
    stream_chunk,
    usage_chunk,
)
from kvrelay.router.plan import PlanChoice
from kvrelay.router.prompt_logprobs import add_prompt_logprobs, prompt_logprobs_body
from kvrelay.router.queue import RUN_STAGES, QueueConfig, QueueMetrics, Ticket, compact
from kvrelay.router.reasoning import ReasoningStream
from kvrelay.router.reasoning import split as split_reasoning
from kvrelay.router.request_trace import RequestTrace, RunTrace
from kvrelay.router.text_output import SampleText
from kvrelay.router.tool_calls import ParsedOutput, StreamDelta, ToolStream, default_parser
from kvrelay.router.vllm_metrics import SampleClock, VllmRequestMetrics
from kvrelay.transfer.bounded_write import write_within
from kvrelay.transfer.discovery import Resolver, getaddrinfo_resolver
from kvrelay.transfer.wire import TENANT_SALT_BYTES
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # what a 429 or 503 answer tells the client to wait, in seconds, unless it says otherwise
PUMP_INTERVAL_S = 0.25


class ClientStalled(Exception):
    """The client stopped reading its answer (`RouterConfig.write_stall_timeout_s`); its connection is cut."""


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvrelay_requests", "Requests by outcome", ["role", "status"], registry=self.registry)
        self.running = Gauge("kvrelay_running_requests", "Requests in flight", ["role"], registry=self.registry)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("kvrelay_ttft_seconds", "Time to first token", registry=self.registry, buckets=buckets)
        self.tpot = Histogram("kvrelay_tpot_seconds", "Time per output token after the first",
                              registry=self.registry, buckets=buckets)
        self.queued = Gauge("kvrelay_router_queued_requests", "Generation requests waiting in the router for room",
                            registry=self.registry)
        self.queue_wait = Histogram("kvrelay_router_queue_wait_seconds", "Time a request waited in the router's "
                                    "queue for room", registry=self.registry, buckets=buckets + (120, 300))
        self.refused = Counter("kvrelay_router_refused", "Requests the router's queue refused (429), by reason: "
                               "queue_full, fair_share, predicted_wait, deadline", ["reason"], registry=self.registry)
        self.migrations = Counter("kvrelay_router_migrations", "Moves of a request to another decode node after its "
                                  "own failed mid-stream (moved), and requests that could not move (limit: "
                                  "router.migration_limit reached; no_node: no other decode node)", ["outcome"],
                                  registry=self.registry)
        self.aborts = Counter("kvrelay_router_aborts", "Generation requests whose client left before they ended, by "
                              "the stage they were in (router.queue.RUN_STAGES: queued, prefill, pull, decode); "
                              "their blocks and leases are given back then, not at the lease TTL", ["stage"],
                              registry=self.registry)
        for stage in RUN_STAGES:
            self.aborts.labels(stage)
        self.slow_polls = Counter("kvrelay_router_slow_node_polls", "Health polls a node answered late (or not "
                                  "in time) while it took connections: counted, the node stays in", ["node"],
                                  registry=self.registry)

        self.plans = Counter("kvrelay_router_plans", "Requests by where their prompt was prefilled (router.plan): "
                             "disaggregated (a prefill node, KV pulled) or local (the decode node)", ["plan"],
                             registry=self.registry)
        self.plan_ttft_error = Histogram(
            "kvrelay_router_plan_ttft_error_ratio", "|predicted - actual| / actual of the time from placement to the "
            "first token, for requests placed with a prediction (router.plan)", ["plan"], registry=self.registry,
            buckets=(0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10))
        self.plan_ttft = Counter("kvrelay_router_plan_ttft_seconds", "Predicted and actual times from placement to the "
                                 "first token, summed, for requests placed with a prediction", ["plan", "kind"],
                                 registry=self.registry)

    def planned(self, choice: PlanChoice, ttft_s: float) -> None:
        """Count one request's plan and, when it had a prediction, how far off it was."""
        self.plans.labels(choice.plan).inc()
        if not math.isnan(choice.predicted_ttft_s) and ttft_s > 0:
            self.plan_ttft_error.labels(choice.plan).observe(abs(choice.predicted_ttft_s - ttft_s) / ttft_s)
            self.plan_ttft.labels(choice.plan, "predicted").inc(choice.predicted_ttft_s)
            self.plan_ttft.labels(choice.plan, "actual").inc(ttft_s)

    def queue_metrics(self) -> QueueMetrics:
        return QueueMetrics(queued=self.queued.set, waited=self.queue_wait.observe,
                            refused=lambda reason: self.refused.labels(reason).inc())


def salt_for_key(api_key: str | None) -> bytes:
    """Per-tenant cache salt: derived from the API key by the router, never taken from the client."""
    if api_key is None:
        return b""
    return hashlib.sha256(b"kvrelay.salt.v1" + api_key.encode()).digest()[:TENANT_SALT_BYTES]


class Router:
    """``resolver``: how DNS names become addresses (`transfer.discovery`; tests pass their own). ``tracing``:
    where each request's trace goes (`node.tracing`, `router.request_trace`; default off)."""

    def __init__(self, config: RouterConfig, *, resolver: Resolver = getaddrinfo_resolver,
                 tracing: Tracing | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing.off()
        self.metrics = RouterMetrics()
        self.backends = Backends(internal_token=config.internal_token, timeout_s=config.request_timeout_s,
                                 connect_timeout_s=config.connect_timeout_s,
                                 max_connections_per_node=config.max_connections_per_node,
                                 node_keepalive_s=config.node_keepalive_timeout_s)
        self.num_admitted = 0  # requests between admission and their last byte
        self.bodies = BodyBuffer(limit_bytes=config.max_buffered_body_bytes, max_body_bytes=config.max_body_bytes,
                                 timeout_s=config.body_read_timeout_s)
        self.nodes: NodeSet | None = None
        self.dispatcher: Dispatcher | None = None
        self.served: ServedModel | None = None
        self.compile_budget = CompileBudget(config.compile_budget)  # new constraints per tenant (429 past it)
        self.vllm: VllmRequestMetrics | None = None  # vLLM's request-level families: made at start (max_model_len)
        self.membership = Membership(config, self.backends, resolver=resolver,
                                     on_slow=lambda node: self.metrics.slow_polls.labels(node.name).inc())
        self._pump_task: asyncio.Task | None = None

    # ------------------------------------------------------------ lifecycle
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        await self.backends.start()
        cfg = self.config
        info = await self.membership.cluster_info()
        self.nodes = NodeSet(cfg.prefill_urls, cfg.decode_urls, block_size_tokens=info.block_size_tokens,
                             load_weight_tokens=cfg.load_weight_tokens, retry_after_s=cfg.node_retry_s,
                             disaggregation=cfg.disaggregation, tpot_slo_s=cfg.tpot_slo_s, ttft_slo_s=cfg.ttft_slo_s)
        self.dispatcher = Dispatcher(self.nodes, self.backends, info, queue=QueueConfig(
            max_requests=cfg.max_queued_requests, max_bytes=cfg.max_queued_bytes, timeout_s=cfg.queue_timeout_s,
            decode_reserve_tokens=cfg.decode_reserve_tokens), queue_metrics=self.metrics.queue_metrics(),
            migration_limit=cfg.migration_limit, migrated=lambda outcome: self.metrics.migrations.labels(outcome).inc(),
            planned=self.metrics.planned)
        tokenizer = load_tokenizer(cfg.model_dir)
        if cfg.chat_template is not None and tokenizer is not None:  # checked at config time: it compiles
            tokenizer.chat_template = resolve_chat_template(cfg.chat_template)
            log.info("chat template: %s in place of the model's", cfg.chat_template if len(cfg.chat_template) < 200
                     else "the inline template")
        defaults = load_generation_defaults(cfg.model_dir, cfg.generation_config)
        log.info("generation config %s: %s", cfg.generation_config,
                 ", ".join(f"{k}={v}" for k, v in defaults.applied) if defaults.applied
                 else "vLLM's neutral defaults (nothing taken from the model's generation_config.json)")
        parser = cfg.tool_call_parser or default_parser(
            cfg.model_dir, tokenizer.chat_template if tokenizer is not None else None)
        if cfg.enable_auto_tool_choice and parser is None:
            log.warning("router.enable_auto_tool_choice is set but no tool-call parser fits %s; tool_choice auto "
                        "is refused until router.tool_call_parser (--tool-call-parser) names one", cfg.model_dir)
        self.vllm = VllmRequestMetrics(self.metrics.registry, model_name=cfg.model_name,
                                       max_model_len=info.max_model_len)
        harmony = served_encoding(cfg.model_dir, reasoning_parser=cfg.reasoning_parser, vocab_size=info.vocab_size)
        if harmony is not None:
            log.info("gpt-oss: chat rendered and parsed in the harmony format (reasoning_content, tool calls)")
        self.served = ServedModel(cfg.model_name, info.vocab_size, info.max_model_len, cfg.max_n, tokenizer,
                                  tool_call_parser=parser, enable_auto_tool_choice=cfg.enable_auto_tool_choice,
                                  reasoning_parser=cfg.reasoning_parser if harmony is None else None,
                                  harmony=harmony,
                                  return_tokens_as_token_ids=cfg.return_tokens_as_token_ids, defaults=defaults,
                                  eos_token_ids=info.eos_token_ids, grammar_limits=cfg.grammar_limits)
        self.membership.start(self.nodes, on_change=self.dispatcher.queue.pump)
        self._pump_task = asyncio.create_task(self._pump_periodically())

    async def _pump_periodically(self) -> None:
        """Place queued requests also when room comes back without an event (a node's retry time ends)."""
        assert self.dispatcher is not None
        while True:
            await asyncio.sleep(PUMP_INTERVAL_S)
            self.dispatcher.queue.pump()

    async def _stop(self, app: web.Application) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()
        self.membership.stop()
        await self.backends.close()

    # -------------------------------------------------------------- helpers
    def _auth(self, request: web.Request) -> bytes:
        """The tenant's cache salt. Raises ApiError(401) for a missing or wrong key."""
        keys = self.config.api_keys
        if not keys:
            return salt_for_key(None)
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        for key in keys:
            if given and hmac.compare_digest(given.encode(), key.encode()):
                return salt_for_key(key)
        raise ApiError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                       kind="authentication_error")

    async def _body(self, request: web.Request) -> Any:
        """The JSON body, read within ``body_read_timeout_s`` (a client trickling it gets 408) and the router's
        byte budget for bodies (`router.body_buffer`). Raises ApiError."""
        return await self.bodies.read_json(request)

    def _error(self, exc: ApiError) -> web.Response:
        self.metrics.requests.labels("router", str(exc.status)).inc()
        retry_after_s = RETRY_AFTER_S if exc.retry_after_s is None else exc.retry_after_s
        headers = {"Retry-After": str(retry_after_s)} if exc.status in (429, 503) else None
        resp = web.json_response(exc.body(), status=exc.status, headers=headers)
        if isinstance(exc, BodyRefused):  # the rest of the body may still trickle in: do not wait to read it
            resp.force_close()
        return resp

    async def _write(self, request: web.Request, resp: web.StreamResponse, data: bytes = b"", *,
                     eof: bool = False) -> None:
        """Write ``data`` to the client (then end the answer if ``eof``), within ``write_stall_timeout_s``.

        Raises:
            ClientStalled: the client stopped reading; its connection is cut (aborted).
        """
        timeout_s = self.config.write_stall_timeout_s
        if not await write_within(request, resp, data, eof=eof, timeout_s=timeout_s):
            self.metrics.requests.labels("router", "client_stalled").inc()
            raise ClientStalled(f"the client did not read its answer for {timeout_s:g} s "
                                "(router.write_stall_timeout_s); dropped")

    # ------------------------------------------------------------- handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_completions)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_chat)

    async def _handle(self, request: web.Request, parse: Any) -> web.StreamResponse:
        """One generation request, with its trace (`RequestTrace`: stage timings, spans when tracing is on)."""
        trace = RequestTrace(self.tracing, request.headers, arrived_ns=time.time_ns())
        status = "error"
        try:
            resp = await self._handle_traced(request, parse, trace)
            status = str(resp.status)
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            status = trace.status or "client_closed"
            raise
        finally:
            trace.end(status=status, output_tokens=trace.num_tokens)

    async def _handle_traced(self, request: web.Request, parse: Any, trace: RequestTrace) -> web.StreamResponse:
        try:
            salt = self._auth(request)
            body = await self._body(request)  # before a slot is taken: a client trickling its body holds none
        except ApiError as exc:
            return self._error(exc)
        if self.num_admitted >= self.config.max_concurrent_requests:  # before parsing anything
            return self._error(ApiError(429, f"the router is serving {self.num_admitted} requests, its limit "
                                             "(router.max_concurrent_requests); retry later"))
        self.num_admitted += 1
        self.metrics.running.labels("router").inc()
        tickets: list[Ticket] = []
        claim: Claim | None = None
        try:
            try:
                assert self.served is not None and self.dispatcher is not None
                # Tokenizing and templating can take a while for a long prompt: off the event loop.
                parsed = await asyncio.get_running_loop().run_in_executor(None, parse, body, self.served)
                body = None  # parsed: the JSON goes (a queued request holds its compact prompt, no more)
                reqs: list[GenerationRequest] = [compact(r) for r in (parsed if isinstance(parsed, list) else [parsed])]
                parsed = None
                for req in reqs:
                    self._check_long_context(req)
                claim = self._claim_compile(salt, reqs[0])
                tickets = self.dispatcher.admit(reqs, salt)
            except ApiError as exc:
                return self._error(exc)
            trace.admitted([r.request_id for r in reqs], prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs))
            if reqs[0].stream:
                return await self._stream(request, reqs, salt, tickets, trace)
            resp = await self._complete(reqs, salt, tickets, trace)
            try:
                await self._write(request, resp, eof=True)  # here, so that a client that never reads is cut off
            except ClientStalled as exc:
                log.info("%s: %s", request.remote, exc)
            return resp
        except (ConnectionResetError, asyncio.CancelledError):  # the client left: each unfinished run is aborted
            for ticket in tickets:
                if ticket.stage != "done":
                    self.metrics.aborts.labels(ticket.stage).inc()
            raise
        finally:
            assert self.dispatcher is not None
            for ticket in tickets:  # a request that ended before its run began gives its place back
                if not ticket.taken:
                    self.dispatcher.queue.abandon(ticket)
            if claim is not None:
                self._release_compile(claim, trace)
            self.num_admitted -= 1
            self.metrics.running.labels("router").dec()

    def _claim_compile(self, salt: bytes, req: GenerationRequest) -> Claim | None:
        """The request's place in its tenant's compile budget (`router.compile_budget`). Raises ApiError(429)."""
        try:
            return self.compile_budget.claim(salt, req.params.structured_outputs)
        except CompileBudgetExceeded as exc:
            raise ApiError(429, str(exc), param=req.structured_param) from None

    def _release_compile(self, claim: Claim, trace: RequestTrace) -> None:
        """Give the claim back, charging its placement → first token (or end) interval (`RunTrace.timings`)."""
        timings = trace.runs[0].timings if trace.runs else {}
        if "router_queue_s" not in timings:  # never placed: no node compiled it
            self.compile_budget.release(claim, start_s=None, end_s=time.time(), served=False)
            return
        placed_s = trace.runs[0].admitted_ns / 1e9 + timings["router_queue_s"]
        first = timings.get("dispatch_s")
        self.compile_budget.release(claim, start_s=placed_s, end_s=time.time() if first is None else placed_s + first,
                                    served=first is not None)

    def _check_long_context(self, req: GenerationRequest) -> None:
        """Refuse a ``kvrelay.long_context`` override the decode nodes could not run, before any prefill
        (the decode node checks again, e.g. for a host tier). Raises ApiError(400)."""
        if req.long_context is None:
            return
        assert self.dispatcher is not None
        try:
            self.config.long_context.with_overrides(req.long_context).check(self.dispatcher.info.block_size_tokens)
        except ValueError as exc:
            raise ApiError(400, f"kvrelay.{exc}", param="kvrelay.long_context") from None

    async def _run_all(self, reqs: list[GenerationRequest], salt: bytes, tickets: list[Ticket],
                       runs: list[RunTrace]) -> AsyncIterator[tuple[int, SampleDelta]]:
        """``(choice index, delta)`` from every request at once (several prompts in one request: the
        choices of prompt k follow those of the prompts before it; ``runs[k]`` traces prompt k). Closing this
        ends them all."""
        assert self.dispatcher is not None
        starts = [sum(r.params.n for r in reqs[:k]) for k in range(len(reqs))]
        if len(reqs) == 1:
            async for delta in self.dispatcher.run(reqs[0], salt, tickets[0], trace=runs[0]):
                yield delta.index, delta
            return
        queue: asyncio.Queue[tuple[int, SampleDelta | Exception | None]] = asyncio.Queue()

        async def pump(k: int, req: GenerationRequest) -> None:
            assert self.dispatcher is not None
            try:
                async for delta in self.dispatcher.run(req, salt, tickets[k], trace=runs[k]):
                    queue.put_nowait((k, delta))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((k, exc))
            finally:
                queue.put_nowait((k, None))

        tasks = [asyncio.create_task(pump(k, req)) for k, req in enumerate(reqs)]
        try:
            running = len(tasks)
            while running:
                k, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield starts[k] + item.index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _complete(self, reqs: list[GenerationRequest], salt: bytes, tickets: list[Ticket],
                        trace: RequestTrace) -> web.Response:
        assert self.served is not None
        req, choices = reqs[0], [r for r in reqs for _ in range(r.params.n)]
        texts = [self._sample_text(r) for r in choices]
        parts: list[list[str]] = [[r.echo_text] if r.echo_text else [] for r in choices]
        reasons: list[str | None] = [None] * len(choices)
        token_ids: list[list[int]] = [[] for _ in choices]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in choices]
        prompt_of: dict[str, list[PromptTokenLogprobs]] = {}  # a prompt's logprobs, by its request's id
        timer, clock = _Timer(), self._clock(reqs, trace)
        cached = 0  # prompt tokens from a prefix cache, every prompt's
        gen = self._run_all(reqs, salt, tickets, trace.runs)
        try:
            async for i, delta in with_deadline(gen, self.config.request_timeout_s, tickets=tickets):
                timer.tokens(len(delta.token_ids))
                trace.tokens(len(delta.token_ids))
                cached += delta.num_cached_tokens or 0
                if delta.prompt_logprobs is not None:
                    prompt_of[choices[i].request_id] = delta.prompt_logprobs
                if reasons[i] is not None:
                    continue
                clock.tokens(i, len(delta.token_ids))
                token_ids[i].extend(delta.token_ids)
                logprobs[i].extend(delta.logprobs or ())
                t = texts[i]
                parts[i].append(t.push(delta.token_ids))
                if t.stopped:
                    reasons[i] = "stop"
                elif delta.finished:
                    parts[i].append(t.flush())
                    reasons[i] = delta.reason
                if all(r is not None for r in reasons):
                    break
        except ApiError as exc:
            clock.failed("error")
            return self._error(exc)
        except (ConnectionResetError, asyncio.CancelledError):
            clock.failed("abort")
            raise
        finally:
            await gen.aclose()
        timer.observe(self.metrics)
        self.metrics.requests.labels("router", "200").inc()
        tok = self.served.tokenizer
        outputs = ["".join(p) for p in parts]
        thoughts: list[str] | None = None
        if req.kind == "chat" and self.served.reasoning_parser is not None:  # the thinking apart, before tools
            splits = [split_reasoning(self.served.reasoning_parser, o) for o in outputs]
            outputs = [s.content for s in splits]
            thoughts = [s.reasoning for s in splits] if req.include_reasoning else None
        parsed: list[ParsedOutput | None] = [None] * len(choices)
        for i, r in enumerate(choices):  # with tools: each choice's calls, parsed on its own
            if r.tool_output is not None:
                parsed[i] = r.tool_output.parse(outputs[i])
                reasons[i] = r.tool_output.finish_reason(parsed[i], reasons[i] or "stop")
        if req.harmony_calls is not None:  # gpt-oss: parsed from the token ids (`router.harmony_output`)
            assert self.served.harmony is not None
            results = [parse_tokens(self.served.harmony, ids, calls=req.harmony_calls) for ids in token_ids]
            outputs = [r.content or "" for r in results]
            thoughts = [r.reasoning or "" for r in results] if req.include_reasoning else None
            parsed = [ParsedOutput(r.content, r.calls) for r in results]
            reasons = ["tool_calls" if r.calls else reason for r, reason in zip(results, reasons, strict=True)]
        clock.finished(reasons)
        body = full_response(
            req, self.served.name, outputs, reasons, sum(t.num_tokens for t in texts),
            [logprobs_body(req, tok, ids, lps) for ids, lps in zip(token_ids, logprobs, strict=True)],
            prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs), parsed=parsed, cached_tokens=cached,
            reasoning=thoughts)
        if req.params.prompt_logprobs is not None:
            lists = {rid: prompt_logprobs_body(tok, r.prompt_token_ids, prompt_of[rid]) for r in reqs
                     if (rid := r.request_id) in prompt_of}
            add_prompt_logprobs(body, req.kind, [lists.get(r.request_id) for r in choices])
        if req.timings:
            body["kvrelay"] = trace.answer_field()
        return web.json_response(body)

    def _clock(self, reqs: list[GenerationRequest], trace: RequestTrace) -> SampleClock:
        """The vLLM-metrics clock of one API request's samples (choices: prompt k's follow prompt k-1's)."""
        assert self.vllm is not None
        choices = [k for k, r in enumerate(reqs) for _ in range(r.params.n)]
        return SampleClock(self.vllm, trace, prompt_of_choice=choices,
                           prompts=[(len(r.prompt_token_ids), r.params.n, r.params.max_tokens) for r in reqs])

    def _sample_text(self, req: GenerationRequest) -> SampleText:
        assert self.served is not None
        keep = req.tool_output.keep_token_ids if req.tool_output is not None else frozenset()
        return SampleText(self.served.tokenizer, req.stop, keep_special_ids=keep,
                          skip_special_tokens=req.skip_special_tokens, include_stop=req.include_stop_str_in_output)

    async def _stream(self, request: web.Request, reqs: list[GenerationRequest], salt: bytes,
                      tickets: list[Ticket], trace: RequestTrace) -> web.StreamResponse:
        assert self.served is not None
        name = self.served.name
        req, choices = reqs[0], [r for r in reqs for _ in range(r.params.n)]
        texts = [self._sample_text(r) for r in choices]
        tools: list[ToolStream | None] = [r.tool_output.stream() if r.tool_output else None for r in choices]
        parser = self.served.reasoning_parser if req.kind == "chat" else None
        thinking = [ReasoningStream(parser) if parser is not None else None for _ in choices]
        harmony = [HarmonyStream(self.served.harmony, calls=r.harmony_calls)
                   if self.served.harmony is not None and r.harmony_calls is not None else None for r in choices]
        reasons: list[str | None] = [None] * len(choices)
        offsets = [0] * len(choices)  # completions' text_offset of each choice's next token
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        timer, clock = _Timer(), self._clock(reqs, trace)
        cached = 0  # prompt tokens from a prefix cache, every prompt's
        gen = self._run_all(reqs, salt, tickets, trace.runs)
        try:
            async for i, delta in with_deadline(gen, self.config.request_timeout_s, tickets=tickets):
                trace.tokens(len(delta.token_ids))
                cached += delta.num_cached_tokens or 0
                if not resp.prepared:
                    await self._write(request, resp)
                timer.tokens(len(delta.token_ids))
                if reasons[i] is not None:
                    continue
                clock.tokens(i, len(delta.token_ids))
                t = texts[i]
                text = t.push(delta.token_ids)
                if t.stopped:
                    reasons[i] = "stop"
                elif delta.finished:
                    text += t.flush()
                    reasons[i] = delta.reason
                first = t.num_tokens == len(delta.token_ids)
                if first and choices[i].echo_text:
                    text = choices[i].echo_text + text
                lp = logprobs_body(req, self.served.tokenizer, delta.token_ids, delta.logprobs, offsets[i])
                if lp is not None and req.kind == "completion":
                    offsets[i] = next_text_offset(self.served.tokenizer, delta.token_ids, offsets[i])
                thought, split_stream = "", thinking[i]
                if split_stream is not None:  # the thinking apart, before tools
                    piece = split_stream.push(text, final=reasons[i] is not None)
                    thought, text = piece.reasoning if req.include_reasoning else "", piece.content
                calls, tool_stream, tool_output = None, tools[i], choices[i].tool_output
                if tool_stream is not None and tool_output is not None:
                    calls = tool_stream.feed(text)
                    if reasons[i] is not None:
                        calls = calls.then(tool_stream.finish())
                        reasons[i] = tool_output.finish_reason(tool_stream.result(), reasons[i])
                    elif not (first or calls.content or calls.calls or lp or thought):
                        continue  # text held back as possible markup: nothing to send yet
                elif split_stream is not None and not (first or text or thought or lp or reasons[i] is not None):
                    continue  # text held back as a possible tag: nothing to send yet
                harmony_stream = harmony[i]
                if harmony_stream is not None:  # gpt-oss: parsed from the token ids, not the text
                    piece = harmony_stream.push(delta.token_ids)
                    thought = piece.reasoning if req.include_reasoning else ""
                    calls = StreamDelta(piece.content, piece.calls)
                    if reasons[i] is not None and harmony_stream.result().calls:
                        reasons[i] = "tool_calls"
                    if not (first or calls.content or calls.calls or thought or lp or reasons[i] is not None):
                        continue  # header tokens: nothing to send yet
                await self._write(request, resp, _sse(stream_chunk(req, name, i, text, reasons[i], first=first,
                                                                   logprobs=lp, tools=calls, reasoning=thought)))
                if all(r is not None for r in reasons):
                    break
        except ApiError as exc:
            clock.failed("error")
            if not resp.prepared:
                return self._error(exc)
            self.metrics.requests.labels("router", str(exc.status)).inc()
            try:
                await self._write(request, resp, _sse(exc.body()) + b"data: [DONE]\n\n", eof=True)
            except ClientStalled as stalled:
                log.info("request %s: %s", req.request_id, stalled)
            return resp
        except ClientStalled as exc:  # its connection is cut; closing the decode stream aborts the request
            clock.failed("abort")
            log.info("request %s: %s", req.request_id, exc)
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            clock.failed("abort")
            self.metrics.requests.labels("router", "client_closed").inc()
            raise
        finally:
            await gen.aclose()  # closes the decode stream: the decode node aborts the request
        last = usage_chunk(req, name, sum(t.num_tokens for t in texts),
                           sum(len(r.prompt_token_ids) for r in reqs), cached) if req.include_usage else None
        if req.timings:  # on the usage chunk, or on a chunk of its own (no choices, as the usage chunk)
            last = {**(last or extension_chunk(req, name)), "kvrelay": trace.answer_field()}
        tail = _sse(last) if last is not None else b""
        trace.status = "200"  # a client that closes once it has read [DONE] may cancel this handler in the write
        clock.finished(reasons)  # every sample has ended: counted whether or not the client reads the tail
        try:
            await self._write(request, resp, tail + b"data: [DONE]\n\n", eof=True)
        except ClientStalled as exc:
            trace.status = "client_stalled"
            log.info("request %s: %s", req.request_id, exc)
            return resp
        timer.observe(self.metrics)
        self.metrics.requests.labels("router", "200").inc()
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /tokenize`` (as vLLM): ``{"model", "prompt"}`` or ``{"model", "messages"}`` →
        ``{"tokens", "count", "max_model_len"}``."""
        try:
            self._auth(request)
            assert self.served is not None
            body = await self._body(request)
            ids = await asyncio.get_running_loop().run_in_executor(None, parse_tokenize, body, self.served)
        except ApiError as exc:
            return self._error(exc)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.served.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``POST /detokenize`` (as vLLM): ``{"model", "tokens"}`` → ``{"prompt"}``."""
        try:
            self._auth(request)
            assert self.served is not None
            text = parse_detokenize(await self._body(request), self.served)
        except ApiError as exc:
            return self._error(exc)
        return web.json_response({"prompt": text})

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._auth(request)
        except ApiError as exc:
            return self._error(exc)
        assert self.served is not None
        return web.json_response({"object": "list", "data": [{
            "id": self.served.name, "object": "model", "created": 0, "owned_by": "kvrelay",
            "max_model_len": self.served.max_model_len}]})

    async def version(self, request: web.Request) -> web.Response:
        """``GET /version`` (as vLLM): ``{"version": <the installed kvrelay package's version>}``."""
        return web.json_response({"version": package_version()})

    async def health(self, request: web.Request) -> web.Response:
        """200 while a decode node is up, else 503; the body in full only for the token or a key
        (`node.health_access`)."""
        if self.nodes is None:
            return web.json_response({"status": "starting"}, status=503)
        now = time.monotonic()
        nodes = {n.name: {"url": n.url, "healthy": n.healthy(now), "in_flight": n.in_flight,
                          "reserved_blocks": n.reserved_blocks, "reserved_seqs": n.reserved_seqs,
                          "queued_tokens": n.queued_tokens,
                          "reserved_requests": n.reserved_requests,
                          "capacity": None if n.capacity is None else dataclasses.asdict(n.capacity),
                          "kv_keys": self.nodes.index.num_keys(n.name), "last_error": n.last_error,
                          "times_down": n.times_down, "slow_polls": n.slow_polls}
                 for n in self.nodes.all}
        ok = any(n.healthy(now) for n in self.nodes.decode)
        if not sees_internals(request, internal_token=self.config.internal_token, api_keys=self.config.api_keys):
            return bare_health("ok" if ok else "degraded", 200 if ok else 503)
        queue = self.dispatcher.queue if self.dispatcher is not None else None
        return web.json_response({"status": "ok" if ok else "degraded", "pid": os.getpid(),
                                  "admitted": self.num_admitted, "nodes": nodes,
                                  "queued": queue.num_queued if queue else 0,
                                  "predicted_wait_s": round(queue.predicted_wait_s(), 3) if queue else 0.0},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class _Timer:
    """kvrelay's TTFT and TPOT of one request (all its samples together; vLLM's families: `SampleClock`)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.count = 0

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.first is None and n:
            self.first = now
        self.last = now
        self.count += n

    def observe(self, metrics: RouterMetrics) -> None:
        if self.first is None:
            return
        metrics.ttft.observe(self.first - self.start)
        if self.count > 1:
            metrics.tpot.observe((self.last - self.first) / (self.count - 1))


def package_version() -> str:
    """The installed ``kvrelay`` distribution's version (``0+unknown`` when it is not installed)."""
    try:
        return importlib.metadata.version("kvrelay")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
