"""The router: the client-facing OpenAI-compatible API.

    POST /v1/completions, /v1/chat/completions   (stream: SSE ending with ``data: [DONE]``)
    POST /tokenize, /detokenize
    GET  /v1/models, /health, /metrics
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.long_context import LongContextConfig
from kvstore.checks import require_int
from model.sampling_params import TokenLogprobs
from model.tokenizer import load_tokenizer
from router.backends import Backends, NodeUnavailable
from router.dispatch import ClusterInfo, Dispatcher, SampleDelta
from router.nodes import Node, NodeSet
from router.openai_api import (
    ApiError,
    GenerationRequest,
    ServedModel,
    full_response,
    logprobs_body,
    parse_chat,
    parse_completions,
    parse_detokenize,
    parse_tokenize,
    stream_chunk,
    usage_chunk,
)
from router.text_output import SampleText
from transfer.discovery import NodeAddresses, Resolver, getaddrinfo_resolver, parse_dns_name
from transfer.wire import TENANT_SALT_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")
# A node that has never answered is polled every round; say so at these failure counts (not at every try).
UNSEEN_WARN_AFTER = frozenset({50, 300, 1200})
EVENT_ANSWER_TIMEOUT_S = 5.0  # beyond the long-poll wait: a node slower than this is taken out
RETRY_AFTER_S = 1  # what a 429 or 503 answer tells the client to wait, in seconds


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router settings. ``api_keys`` empty: no authentication and one shared cache salt."""

    model_name: str
    model_dir: str
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    # host:port names whose every address is a node (a k8s headless Service), re-resolved every dns_interval_s
    prefill_dns: tuple[str, ...] = ()
    decode_dns: tuple[str, ...] = ()
    dns_interval_s: float = 10.0
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1024 * 1024
    request_timeout_s: float = 300.0
    max_n: int = 4
    internal_token: str | None = None
    load_weight_tokens: int = 64
    event_poll_interval_s: float = 0.1  # least time between two event requests to one node
    event_wait_s: float = 2.0  # how long a node may hold an event request that has no news
    node_retry_s: float = 5.0
    startup_timeout_s: float = 120.0
    max_concurrent_requests: int = 1024  # admitted at once; more get 429 with Retry-After
    max_connections_per_node: int = 1024  # pooled request connections to each node
    connect_timeout_s: float = 5.0  # the TCP connect to a node (not the wait for a pooled connection)
    long_context: LongContextConfig = LongContextConfig()  # the decode nodes' default (decode.long_context)

    def __post_init__(self) -> None:
        """Raises ValueError naming the field (as in the YAML ``router`` section)."""
        for url in (*self.prefill_urls, *self.decode_urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"node URLs must start with http:// or https://, got {url!r}")
        for name in (*self.prefill_dns, *self.decode_dns):
            parse_dns_name(name)
        if not (self.decode_urls or self.decode_dns) and (self.prefill_urls or self.prefill_dns):
            raise ValueError("prefill nodes need at least one decode node (decode_urls and decode_dns are empty)")
        require_int("port", self.port, minimum=0, maximum=65535)
        require_int("max_body_bytes", self.max_body_bytes)
        require_int("max_n", self.max_n)
        require_int("load_weight_tokens", self.load_weight_tokens, minimum=0)
        require_int("max_concurrent_requests", self.max_concurrent_requests)
        require_int("max_connections_per_node", self.max_connections_per_node)
        for name in ("request_timeout_s", "node_retry_s", "startup_timeout_s", "connect_timeout_s", "dns_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not self.event_poll_interval_s >= 0:
            raise ValueError(f"event_poll_interval_s must be >= 0 seconds, got {self.event_poll_interval_s!r}")
        if not 0 <= self.event_wait_s <= 30:  # what a node accepts as /kv/events?wait_s
            raise ValueError(f"event_wait_s must be in [0, 30] seconds, got {self.event_wait_s!r}")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvrelay_requests", "Requests by outcome", ["role", "status"], registry=self.registry)
        self.running = Gauge("kvrelay_running_requests", "Requests in flight", ["role"], registry=self.registry)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("kvrelay_ttft_seconds", "Time to first token", registry=self.registry, buckets=buckets)
        self.tpot = Histogram("kvrelay_tpot_seconds", "Time per output token after the first",
                              registry=self.registry, buckets=buckets)
        # vLLM's names, beside ours (same observations), so that its dashboards work.
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                   registry=self.registry, buckets=buckets)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first",
                                   registry=self.registry, buckets=buckets)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token",
                                  registry=self.registry, buckets=buckets + (120, 300, 600))


def salt_for_key(api_key: str | None) -> bytes:
    """Per-tenant cache salt: derived from the API key by the router, never taken from the client."""
    if api_key is None:
        return b""
    return hashlib.sha256(b"kvrelay.salt.v1" + api_key.encode()).digest()[:TENANT_SALT_BYTES]


class Router:
    """``resolver``: how DNS names become addresses (`transfer.discovery`; tests pass their own)."""

    def __init__(self, config: RouterConfig, *, resolver: Resolver = getaddrinfo_resolver) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.backends = Backends(internal_token=config.internal_token, timeout_s=config.request_timeout_s,
                                 connect_timeout_s=config.connect_timeout_s,
                                 max_connections_per_node=config.max_connections_per_node)
        self.num_admitted = 0  # requests between admission and their last byte
        self.nodes: NodeSet | None = None
        self.dispatcher: Dispatcher | None = None
        self.served: ServedModel | None = None
        self._addresses = {"prefill": NodeAddresses(config.prefill_urls, config.prefill_dns, resolver=resolver),
                           "decode": NodeAddresses(config.decode_urls, config.decode_dns, resolver=resolver)}
        self._pollers: dict[str, asyncio.Task] = {}  # node URL -> its event poller
        self._discovery: asyncio.Task | None = None

    # ------------------------------------------------------------ lifecycle
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
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
        info = await self._cluster_info()
        self.nodes = NodeSet(cfg.prefill_urls, cfg.decode_urls, block_size_tokens=info.block_size_tokens,
                             load_weight_tokens=cfg.load_weight_tokens, retry_after_s=cfg.node_retry_s)
        self.dispatcher = Dispatcher(self.nodes, self.backends, info)
        self.served = ServedModel(cfg.model_name, info.vocab_size, info.max_model_len, cfg.max_n,
                                  load_tokenizer(cfg.model_dir))
        for node in self.nodes.all:
            self._start_poller(node)
        if any(a.dynamic for a in self._addresses.values()):
            self._discovery = asyncio.create_task(self._discover())

    async def _stop(self, app: web.Application) -> None:
        for task in (*self._pollers.values(), self._discovery):
            if task is not None:
                task.cancel()
        await self.backends.close()

    async def _cluster_info(self) -> ClusterInfo:
        """Model and block layout from the first node that answers ``/info`` (resolving the DNS names
        again while none does)."""
        if not any(a.urls or a.dynamic for a in self._addresses.values()):
            raise RuntimeError("router: no prefill or decode nodes configured")
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            for addresses in self._addresses.values():
                await addresses.refresh()
            nodes = [Node("probe", url, "probe") for a in self._addresses.values() for url in sorted(a.urls)]
            for node in nodes:
                try:
                    info = await self.backends.get_msgpack(node, "/info")
                except NodeUnavailable:
                    continue
                if info["model"] != self.config.model_name:
                    raise RuntimeError(f"router serves model {self.config.model_name!r} but {node.url} serves "
                                       f"{info['model']!r}")
                return ClusterInfo(int(info["block_size_tokens"]), bytes(info["spec_fingerprint"]),
                                   int(info["vocab_size"]), int(info["max_model_len"]),
                                   tuple(info["eos_token_ids"]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"router: no node answered /info within {self.config.startup_timeout_s} s")
            await asyncio.sleep(0.2)

    def _start_poller(self, node: Node) -> None:
        self._pollers[node.url] = asyncio.create_task(self._poll_node(node))

    async def _discover(self) -> None:
        """Follow the DNS names: a new address joins once it answers ``/info`` (under the name it gives
        itself); an address that vanished leaves. Every ``dns_interval_s``."""
        assert self.nodes is not None
        while True:
            for role, addresses in self._addresses.items():
                try:
                    await self._discover_role(role, addresses)
                except Exception:  # noqa: BLE001 - keep following the names
                    log.exception("discovering %s nodes failed", role)
            await asyncio.sleep(self.config.dns_interval_s)

    async def _discover_role(self, role: str, addresses: NodeAddresses) -> None:
        assert self.nodes is not None
        _, removed = await addresses.refresh()
        nodes = self.nodes.prefill if role == "prefill" else self.nodes.decode
        for node in [n for n in nodes if n.url in removed]:
            log.info("%s node %s at %s left (its %d requests in flight go on)", role, node.name, node.url,
                     node.in_flight)
            self.nodes.remove(node)  # its poller stops once nothing is in flight there
        known = {n.url for n in nodes}
        for url in sorted(addresses.urls - known):
            try:
                info = await self.backends.get_msgpack(Node("new", url, role), "/info")
            except NodeUnavailable:
                continue  # not up yet: the next round asks again
            if info.get("role") != role or info.get("model") != self.config.model_name:
                log.warning("%s answers as a %s node of %r, not a %s node of %r; ignored", url, info.get("role"),
                            info.get("model"), role, self.config.model_name)
                continue
            node = self.nodes.add(role, url, str(info["node"]))  # replaces the same name at an old address
            log.info("%s node %s joined at %s", role, node.name, url)
            self._start_poller(node)

    async def _poll_node(self, node: Node) -> None:
        """Long-poll one node's ``/kv/events``: it answers at once when it has news, else after
        ``event_wait_s``; an idle cluster costs one request per node every ``event_wait_s``."""
        assert self.nodes is not None
        cfg = self.config
        while True:
            if not self.nodes.has(node) and node.in_flight == 0:  # it left the cluster, and nothing waits on it
                if self._pollers.get(node.url) is asyncio.current_task():
                    del self._pollers[node.url]
                return
            now = time.monotonic()
            if node.seen and not node.healthy(now):
                await asyncio.sleep(max(node.down_until - now, cfg.event_poll_interval_s))  # taken out: retry later
                continue
            after = self.nodes.index.node_to_last_seq.get(node.name, 0)
            wait_s = cfg.event_wait_s if node.seen else 0.0
            try:
                batch = await self.backends.get_msgpack(node, f"/kv/events?after={after}&wait_s={wait_s:g}",
                                                        timeout_s=wait_s + EVENT_ANSWER_TIMEOUT_S)
                self._apply_events(node, batch)
            except Exception as exc:  # noqa: BLE001 - one bad node must not stop its poller
                if node.seen and node.healthy(now):
                    log.warning("node %s: %s; taken out for %.0f s", node.name, exc, cfg.node_retry_s)
                elif not node.seen and node.failures + 1 in UNSEEN_WARN_AFTER:
                    log.warning("node %s has not answered yet (%d tries): %s", node.name, node.failures + 1, exc)
                self.nodes.mark_unreachable(node, f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(cfg.event_poll_interval_s)

    def _apply_events(self, node: Node, batch: Any) -> None:
        """Fold one ``/kv/events`` answer into the index. Raises on a malformed batch."""
        assert self.nodes is not None
        if not self.nodes.has(node):  # it left (its poller only waits for its requests): no routing by its KV
            return
        if batch["snapshot"] is not None:
            self.nodes.index.replace(node.name, batch["snapshot"], batch["last_seq"])
        else:
            stored = [e[2] for e in batch["events"] if e[1] == "stored"]
            removed = [e[2] for e in batch["events"] if e[1] == "removed"]
            self.nodes.index.apply(node.name, stored, removed, batch["last_seq"])
        self.nodes.mark_up(node)

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
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body exceeds the {self.config.max_body_bytes}-byte limit") from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply") from None

    def _error(self, exc: ApiError) -> web.Response:
        self.metrics.requests.labels("router", str(exc.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in (429, 503) else None
        return web.json_response(exc.body(), status=exc.status, headers=headers)

    # ------------------------------------------------------------- handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_completions)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_chat)

    async def _handle(self, request: web.Request, parse: Any) -> web.StreamResponse:
        if self.num_admitted >= self.config.max_concurrent_requests:  # before reading or parsing anything
            return self._error(ApiError(429, f"the router is serving {self.num_admitted} requests, its limit "
                                             "(router.max_concurrent_requests); retry later"))
        self.num_admitted += 1
        self.metrics.running.labels("router").inc()
        try:
            try:
                salt = self._auth(request)
                assert self.served is not None
                body = await self._body(request)
                # Tokenizing and templating can take a while for a long prompt: off the event loop.
                parsed = await asyncio.get_running_loop().run_in_executor(None, parse, body, self.served)
                reqs: list[GenerationRequest] = parsed if isinstance(parsed, list) else [parsed]
                for req in reqs:
                    self._check_long_context(req)
            except ApiError as exc:
                return self._error(exc)
            if reqs[0].stream:
                return await self._stream(request, reqs, salt)
            return await self._complete(reqs, salt)
        finally:
            self.num_admitted -= 1
            self.metrics.running.labels("router").dec()

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

    async def _run_all(self, reqs: list[GenerationRequest], salt: bytes) -> AsyncIterator[tuple[int, SampleDelta]]:
        """``(choice index, delta)`` from every request at once (several prompts in one request: the
        choices of prompt k follow those of the prompts before it). Closing this ends them all."""
        assert self.dispatcher is not None
        starts = [sum(r.params.n for r in reqs[:k]) for k in range(len(reqs))]
        if len(reqs) == 1:
            async for delta in self.dispatcher.run(reqs[0], salt):
                yield delta.index, delta
            return
        queue: asyncio.Queue[tuple[int, SampleDelta | Exception | None]] = asyncio.Queue()

        async def pump(k: int, req: GenerationRequest) -> None:
            assert self.dispatcher is not None
            try:
                async for delta in self.dispatcher.run(req, salt):
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

    async def _complete(self, reqs: list[GenerationRequest], salt: bytes) -> web.Response:
        assert self.served is not None
        req, choices = reqs[0], [r for r in reqs for _ in range(r.params.n)]
        texts = [SampleText(self.served.tokenizer, r.stop) for r in choices]
        parts: list[list[str]] = [[r.echo_text] if r.echo_text else [] for r in choices]
        reasons: list[str | None] = [None] * len(choices)
        token_ids: list[list[int]] = [[] for _ in choices]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in choices]
        timer = _Timer()
        gen = self._run_all(reqs, salt)
        try:
            async for i, delta in _with_deadline(gen, self.config.request_timeout_s):
                timer.tokens(len(delta.token_ids))
                if reasons[i] is not None:
                    continue
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
            return self._error(exc)
        finally:
            await gen.aclose()
        timer.observe(self.metrics)
        self.metrics.requests.labels("router", "200").inc()
        tok = self.served.tokenizer
        return web.json_response(full_response(
            req, self.served.name, ["".join(p) for p in parts], reasons, sum(t.num_tokens for t in texts),
            [logprobs_body(req, tok, ids, lps) for ids, lps in zip(token_ids, logprobs, strict=True)],
            prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs)))

    async def _stream(self, request: web.Request, reqs: list[GenerationRequest],
                      salt: bytes) -> web.StreamResponse:
        assert self.served is not None
        name = self.served.name
        req, choices = reqs[0], [r for r in reqs for _ in range(r.params.n)]
        texts = [SampleText(self.served.tokenizer, r.stop) for r in choices]
        reasons: list[str | None] = [None] * len(choices)
        offsets = [0] * len(choices)  # completions' text_offset of each choice's next token
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        timer = _Timer()
        gen = self._run_all(reqs, salt)
        try:
            async for i, delta in _with_deadline(gen, self.config.request_timeout_s):
                if not resp.prepared:
                    await resp.prepare(request)
                timer.tokens(len(delta.token_ids))
                if reasons[i] is not None:
                    continue
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
                if lp is not None and req.kind == "completion" and lp["tokens"]:
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                await _sse(resp, stream_chunk(req, name, i, text, reasons[i], first=first, logprobs=lp))
                if all(r is not None for r in reasons):
                    break
        except ApiError as exc:
            if not resp.prepared:
                return self._error(exc)
            self.metrics.requests.labels("router", str(exc.status)).inc()
            await _sse(resp, exc.body())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.requests.labels("router", "client_closed").inc()
            raise
        finally:
            await gen.aclose()  # closes the decode stream: the decode node aborts the request
        if req.include_usage:
            await _sse(resp, usage_chunk(req, name, sum(t.num_tokens for t in texts),
                                         sum(len(r.prompt_token_ids) for r in reqs)))
        await resp.write(b"data: [DONE]\n\n")
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

    async def health(self, request: web.Request) -> web.Response:
        if self.nodes is None:
            return web.json_response({"status": "starting"}, status=503)
        now = time.monotonic()
        nodes = {n.name: {"url": n.url, "healthy": n.healthy(now), "in_flight": n.in_flight,
                          "kv_keys": self.nodes.index.num_keys(n.name), "last_error": n.last_error,
                          "times_down": n.times_down}
                 for n in self.nodes.all}
        ok = any(n.healthy(now) for n in self.nodes.decode)
        return web.json_response({"status": "ok" if ok else "degraded", "pid": os.getpid(),
                                  "admitted": self.num_admitted, "nodes": nodes},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class _Timer:
    """TTFT, TPOT and end-to-end latency of one request."""

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
        metrics.vllm_ttft.observe(self.first - self.start)
        metrics.vllm_e2e.observe(self.last - self.start)
        if self.count > 1:
            tpot = (self.last - self.first) / (self.count - 1)
            metrics.tpot.observe(tpot)
            metrics.vllm_tpot.observe(tpot)


async def _with_deadline(gen: AsyncIterator[T], timeout_s: float) -> AsyncIterator[T]:
    """Items of ``gen`` until it ends; ApiError(504) once ``timeout_s`` have passed in all."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            item = await asyncio.wait_for(gen.__anext__(), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise ApiError(504, f"request did not finish within {timeout_s} s") from None
        yield item


async def _sse(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
