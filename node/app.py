"""`EngineNode`: what every engine-backed service (prefill, decode) serves besides its own API.

    GET /health       liveness and load (no token needed: for probes)
    GET /ready        readiness: 200 while the node takes new requests (no token needed)
    GET /metrics      Prometheus text (no token needed)
    GET /info         model and block layout the router needs to compute block keys (msgpack)
    GET /kv/events    ?after=SEQ[&wait_s=W]: block stored/removed events, or a snapshot on a gap (msgpack);
                      with nothing new, waits up to W s (≤ MAX_EVENT_WAIT_S) for an event first

Every path but /health, /ready and /metrics requires ``X-Kvrelay-Token`` when an internal token is set.

A node whose engine thread is stuck in one pass of its loop (a step, a pool call) for more than
``stall_timeout_s`` while it has work — a hung NIXL call, a CPU lock a neighbour never gives back — is
given up (`EngineNode._watch_engine`): /health and /ready answer 503 with the reason, the requests
waiting on it end with a 503 naming the stall, and after `STALL_EXIT_AFTER_S` the app's `ENGINE_STALLED`
hook runs (`deploy.serve` exits the process, for `kvrelay up` or Kubernetes to start a fresh one).
An idle engine, or one waiting for blocks that leases or pulls hold, is not in a pass: never stalled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from aiohttp import web
from kvrelay.engine.grammar import GrammarError
from kvrelay.engine.step_rates import PullRates
from kvrelay.engine.worker import EngineWorker
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.kv_events import KvEventLog
from kvrelay.node.app_keys import DRAIN, DRAINABLES, ENGINE_STALLED, HEALTH_EXTRAS, Drainable
from kvrelay.node.health_access import bare_health, sees_internals
from kvrelay.node.tracing import Stage, Tracing
from kvrelay.node.vllm_metrics import VllmNodeMetrics
from kvrelay.transfer.config import TOKEN_HEADER
from kvrelay.transfer.wire import GenerationMessage, WireError, decode_generation, pack
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
MAX_EVENT_WAIT_S = 30.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ADMITTED_PATHS = frozenset({"/prefill", "/generate"})  # counted against max_pending_requests
CUT_OFF_GRACE_S = 5.0  # after a drain cuts requests off: time for their handlers to send the error frames
# A stalled node answers 503 (and says why) at least this long before its ENGINE_STALLED hook, so that
# probes and the router see the reason; it waits up to CUT_OFF_GRACE_S for its handlers' error answers.
STALL_EXIT_AFTER_S = 2.0


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Identity and limits of one engine node.

    Attributes:
        role: ``prefill`` or ``decode``.
        name: unique node name (appears in KV events and logs).
        max_pending_requests: requests waiting or running beyond which new ones get 429.
        internal_token: shared secret for internal endpoints; None leaves them open (loopback only).
        cpus: the CPUs the node owns (`deploy.cpu_budget`); empty: every CPU it may run on.
        stall_timeout_s: one pass of the engine loop (a step, a pool call) running longer than this, while
            the engine has work, gives the engine up as stalled (see the module docstring). Above the
            longest legitimate step: a ``max_num_batched_tokens`` prefill chunk on a slow CPU, the first
            step's kernel compiles.
        persist_timeout_s: on a planned stop, after the drain: the bound on writing the device and host
            tiers to disk (`TieredStore.persist`).
    """

    role: str
    name: str
    model_name: str
    host: str = "127.0.0.1"
    port: int = 0
    max_pending_requests: int = 256
    internal_token: str | None = None
    cpus: tuple[int, ...] = ()
    stall_timeout_s: float = 60.0
    persist_timeout_s: float = 300.0


class CpuUse(Protocol):
    """What a node's CPU lending reports (`deploy.cpu_budget.CoreLending`)."""

    threads: int
    borrowed_cpu_s: float


class _CpuCollector(Collector):
    """Reads a `CpuUse` at each scrape (its fields are written on the engine thread; a float read is atomic)."""

    def __init__(self, cpus: CpuUse) -> None:
        self._cpus = cpus

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvrelay_engine_threads", "Intra-op threads of the engine's last step: its own "
                                "CPUs plus those borrowed from idle nodes", value=self._cpus.threads)
        yield CounterMetricFamily("kvrelay_engine_borrowed_cpu_seconds", "CPU-seconds of engine steps computed on "
                                  "CPUs borrowed from idle nodes (CPU lending)", value=self._cpus.borrowed_cpu_s)


class NodeMetrics:
    """Prometheus metrics of one node, in its own registry (no process globals). ``model_name``: the served model
    name, the ``model_name`` label of vLLM's families."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None, *, model_name: str,
                 node: str = "") -> None:
        self.registry = registry or CollectorRegistry()
        self.role = role
        # Which node this is (its --name) and its role, for dashboards that scrape many nodes: always 1.
        Gauge("kvrelay_node_info", "This node's name and role", ["node", "role"],
              registry=self.registry).labels(node or role, role).set(1)
        self.requests = Counter("kvrelay_requests", "Requests by outcome", ["role", "status"], registry=self.registry)
        self.running = Gauge("kvrelay_running_requests", "Samples the engine is running (not those waiting)",
                             ["role"], registry=self.registry)
        self.waiting = Gauge("kvrelay_waiting_requests", "Samples waiting to be scheduled", ["role"],
                             registry=self.registry)
        # vLLM's families (names, labels, buckets), beside ours, so that its dashboards work (`node.vllm_metrics`)
        self.vllm = VllmNodeMetrics(self.registry, model_name=model_name)
        self.transfer_bytes = Counter("kvrelay_kv_transfer_bytes", "KV bytes pulled from peers",
                                      registry=self.registry)
        self.transfer_seconds = Histogram("kvrelay_kv_transfer_seconds", "Time to pull a request's KV",
                                          registry=self.registry,
                                          buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.transfer_failures = Counter("kvrelay_kv_transfer_failures", "KV pulls that failed, by reason "
                                         "(transfer.errors.REASONS)", ["reason"], registry=self.registry)
        self.prefix_hit_tokens = Counter("kvrelay_engine_prefix_hit_tokens", "Prompt tokens served from cache",
                                         registry=self.registry)
        self.computed_tokens = Counter("kvrelay_engine_prefill_tokens", "Prompt tokens computed",
                                       registry=self.registry)

        self.engine_stalls = Counter("kvrelay_engine_stalls", "Times the engine thread was given up as stuck "
                                     "(one pass past engine.stall_timeout_s); the node exits after each",
                                     registry=self.registry)
        self.engine_busy_seconds = Gauge("kvrelay_engine_busy_seconds", "How long the engine thread has been in "
                                         "its current step or pool call (0 while it waits for work)",
                                         registry=self.registry)
        self.long_context = Counter("kvrelay_long_context", "Long-context policy work: evicted_tokens (h2o), "
                                    "offloaded_blocks, recalled_layer_blocks (infinigen), deferred, copy_fallbacks",
                                    ["what"], registry=self.registry)

    def watch_cpus(self, cpus: CpuUse) -> None:
        """Export ``cpus``' figures at each scrape: ``kvrelay_engine_threads`` (the intra-op threads of the last
        step: the node's own CPUs plus those borrowed) and ``kvrelay_engine_borrowed_cpu_seconds_total``
        (`deploy.cpu_budget.CoreLending`: CPU-seconds computed on CPUs borrowed from idle nodes)."""
        self.registry.register(_CpuCollector(cpus))

    def request_done(self, status: str) -> None:
        self.requests.labels(self.role, status).inc()


def token_middleware(token: str | None) -> Callable:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and request.path not in OPEN_PATHS:
            given = request.headers.get(TOKEN_HEADER, "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                return web.json_response({"error": f"missing or wrong {TOKEN_HEADER}"}, status=401)
        return await handler(request)

    return check


class EngineNode:
    """Common routes and state of an engine node. Subclasses (services) add their API routes. ``tracing``: where
    the spans of each request go (`node.tracing`; default off)."""

    def __init__(self, config: NodeConfig, worker: EngineWorker, *, metrics: NodeMetrics | None = None,
                 tracing: Tracing | None = None) -> None:
        self.config = config
        self.worker = worker
        self.tracing = tracing or Tracing.off()
        self.engine = worker.engine
        self.metrics = metrics or NodeMetrics(config.role, model_name=config.model_name, node=config.name)
        self.metrics.vllm.watch_steps(self.engine.stats.step_tokens)
        self.events = KvEventLog()
        self.pull_rates = PullRates()  # this node's KV pulls from peers (decode nodes; reported in `load_report`)
        self.engine.pool.add_listener(self.events)
        self.num_admitted = 0  # generation requests between arrival and their last byte (event loop only)
        self.draining = False  # set on a planned stop: new generation requests get 503
        self.drainables: list[Drainable] = []  # what `drain` also waits for (services add theirs: DRAINABLES)
        self._seen: dict[str, int] = {}  # engine counters as of the last scrape (`prometheus`)
        self._long_context_seen: dict[str, int] = {}
        self._watchdog: asyncio.Task[None] | None = None

    def make_app(self, *, client_max_size: int) -> web.Application:
        app = web.Application(middlewares=[token_middleware(self.config.internal_token), self._admission],
                              client_max_size=client_max_size)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/info", self.info)
        app.router.add_get("/kv/events", self.kv_events)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app[DRAIN] = self.drain
        app[DRAINABLES] = self.drainables
        return app

    async def drain(self, timeout_s: float) -> None:
        """A planned stop, within ``timeout_s``: refuse new generation requests (503); wait for the admitted
        ones and for the app's `DRAINABLES` (a prefill node's leases still being read); cut off what is
        still running after that (its stream ends with a 503 error frame, which the router relays as an
        error event); end the drainables (release the leases); then write the device and host tiers'
        keyed blocks to disk (`TieredStore.persist`) so that a restart finds them there."""
        self.draining = True
        drainables = self.drainables
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def busy() -> bool:  # with a dead engine loop there is nothing to wait for but the handlers
            return self.num_admitted > 0 or (self.worker.alive and any(d.pending() for d in drainables))

        while busy() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.num_admitted and self.worker.alive:
            cut = await self.worker.cut_off(f"{self.config.name} is shutting down: the request was cut off "
                                            f"after the {timeout_s:g} s drain")
            log.warning("%s: %d requests still running after the %g s drain; cut off", self.config.name, cut,
                        timeout_s)
            until = loop.time() + CUT_OFF_GRACE_S  # for their handlers to send the error frames
            while self.num_admitted and loop.time() < until:
                await asyncio.sleep(0.02)
        if not self.worker.alive:
            return  # the pools died with the loop: nothing to release or persist
        for drainable in drainables:
            ended = await drainable.end()
            if ended:
                log.info("%s: ended %d outstanding %s at stop", self.config.name, ended, type(drainable).__name__)
        bound_s = self.config.persist_timeout_s
        try:
            # the engine thread's own bound comes first: the call's is only for an engine that stopped answering
            written = await self.worker.call(lambda engine: engine.store.persist(timeout_s=bound_s),
                                             timeout_s=bound_s + 5.0)
        except TimeoutError as exc:
            log.error("%s: writing the KV tiers to disk did not finish within internal.persist_timeout_s = %g s "
                      "(%s); blocks not yet written are lost", self.config.name, bound_s, exc)
            return
        log.info("%s: %d KV blocks written to disk before stopping", self.config.name, written)

    @web.middleware
    async def _admission(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A hard bound on generation requests in the node: counted on the event loop from arrival to
        the last byte (not from the engine's per-step snapshot), so a burst cannot overshoot it."""
        if request.method != "POST" or request.path not in ADMITTED_PATHS:
            return await handler(request)
        if self.draining:
            self.metrics.request_done("overloaded")
            return msgpack_response({"error": f"{self.config.role} node is shutting down; retry elsewhere"},
                                    status=503)
        if self.num_admitted >= self.config.max_pending_requests:
            self.metrics.request_done("overloaded")
            return msgpack_response({"error": f"{self.config.role} node is at capacity "
                                              f"({self.num_admitted} requests); retry later"}, status=429)
        self.num_admitted += 1
        try:
            return await handler(request)
        finally:
            self.num_admitted -= 1

    async def _start(self, app: web.Application) -> None:
        self.worker.start()
        self._watchdog = asyncio.create_task(self._watch_engine(app.get(ENGINE_STALLED)))

    async def _stop(self, app: web.Application) -> None:
        if self.worker.stall_reason is not None:  # nothing stops a stuck thread, nor closes its engine under it
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.worker.stop()

    async def _watch_engine(self, on_stall: Callable[[str], None] | None) -> None:
        """Every ``stall_timeout_s / 4`` (at most 1 s): is the engine thread past ``stall_timeout_s`` in one
        pass? Then give it up (`EngineWorker.give_up`), answer 503 for a while, and call ``on_stall``.
        Stops watching once the node drains (a planned stop has bounded waits of its own)."""
        timeout_s = self.config.stall_timeout_s
        interval_s = min(1.0, timeout_s / 4)
        while self.worker.busy_for_s() <= timeout_s:
            await asyncio.sleep(interval_s)
            if self.draining or not self.worker.alive:
                return
        reason = (f"{self.config.name}'s engine stalled: no step finished in {timeout_s:g} s "
                  f"(engine.stall_timeout_s) while it had work; the node exits, to be restarted")
        self.metrics.engine_stalls.inc()
        ended = self.worker.give_up(reason)
        log.critical("%s; %d requests ended with 503", reason, ended)
        loop = asyncio.get_running_loop()
        until = loop.time() + CUT_OFF_GRACE_S
        await asyncio.sleep(STALL_EXIT_AFTER_S)
        while self.num_admitted and loop.time() < until:
            await asyncio.sleep(0.02)
        if on_stall is not None:
            on_stall(reason)

    async def read_request(self, request: web.Request) -> GenerationMessage | web.Response:
        """The request's message, or the response refusing it: 400 malformed, 503 when
        the engine loop is not running."""
        if not self.worker.alive:
            self.metrics.request_done("error")
            return msgpack_response({"error": self.worker.stall_reason or f"{self.config.role} node's engine is not "
                                              f"running ({self.worker.failure or 'stopped'})"}, status=503)
        try:
            msg = decode_generation(await request.read())
        except WireError as exc:
            self.metrics.request_done("bad_request")
            return msgpack_response({"error": str(exc)}, status=400)
        out = msg.params.structured_outputs
        if out is not None:  # compiled here, off the engine thread, and carried to it with the request
            try:
                compiled = await asyncio.to_thread(self.engine.grammars.compile, out)
                object.__setattr__(out, "compiled", compiled)  # an in-process field of a message decoded just now
            except GrammarError as exc:
                self.metrics.request_done("bad_request")
                return msgpack_response({"error": str(exc)}, status=400)
        return msg

    def trace(self, request: web.Request, stage: Stage, children: Sequence[Stage] = (), *,
              error: str | None = None) -> None:
        """Record one request's spans (`node.tracing`): ``stage`` (the node's whole handling of it) under the caller's
        span named by the request's ``traceparent`` header (none: a trace of its own), ``children`` under it;
        ``error`` marks it failed. A no-op when tracing is off."""
        tracing = self.tracing
        if tracing.tracer is None:
            return
        tracing.record(stage, parent=tracing.parent_from(request.headers), children=children, kind=SpanKind.SERVER,
                       error=error)

    def block_keys_of(self, msg: GenerationMessage) -> list[BlockKey] | None:
        """The keys of the prompt's full blocks, computed once per request here at the edge and handed
        to the engine (and to the KV publish or pull). None for a prompt longer than the engine takes
        (it refuses it with a 400; hashing it first would only cost time)."""
        if len(msg.prompt) > self.engine.max_model_len:
            return None
        return self.engine.prompt_block_keys(msg.prompt, msg.salt)

    async def health(self, request: web.Request) -> web.Response:
        """200 with the node's state, or 503 once its engine loop has died or stopped (so probes and the
        router take it out). Without the internal token only ``{"status": ...}`` (`node.health_access`)."""
        alive = self.worker.alive
        stall = self.worker.stall_reason
        status = "ok" if alive else "engine_stalled" if stall else "engine_down"
        if not sees_internals(request, internal_token=self.config.internal_token):
            return bare_health(status, 200 if alive else 503)
        extras: dict[str, Any] = {}
        for extra in request.app.get(HEALTH_EXTRAS, []):
            extras.update(extra())
        return web.json_response(status=200 if alive else 503, data={
            **extras,
            "status": status,
            "error": stall or self.worker.failure, "role": self.config.role,
            "node": self.config.name, "pid": os.getpid(),
            "cpus": list(self.config.cpus) or sorted(os.sched_getaffinity(0)),
            "cpu_pool": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
            "running": self.worker.num_running, "waiting": self.worker.num_waiting,
            "free_blocks": self.worker.num_free_blocks, "in_use_blocks": self.worker.num_in_use_blocks,
            "total_blocks": self.engine.pool.num_blocks,
            "kv_bytes": self.kv_bytes(),
            "host_reserved_blocks": self.engine.store.host.num_reserved if self.engine.store.host else 0,
            "disk_read_txns": self.engine.store.disk.num_open_read_txns() if self.engine.store.disk else 0,
            # {"state": "open"|"unavailable"|"none", "path", "reason"}: unavailable = serving without it
            "disk_tier": dataclasses.asdict(self.engine.store.disk_status),
            "long_context": dataclasses.asdict(self.engine.policies.stats),
            # the CPU kernel paths this node's steps take, as timed on this machine (`model.kernel_plan`)
            "kernel_plan": self.engine.kernel_plan.summary(),
        })

    def kv_bytes(self) -> dict[str, int]:
        """The bytes of KV this node's tiers hold (``device``, ``host``; ``block``: one block's), as sized at
        start (`deploy.config.KvStoreConfig`: explicit bytes, or a share of the memory free then)."""
        store, block = self.engine.store, self.engine.spec.block_bytes
        return {"device": self.engine.pool.num_blocks * block,
                "host": store.host.num_blocks * block if store.host is not None else 0, "block": block}

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness (a k8s probe, a load balancer): 200 while the node takes new requests; 503 while it
        drains, once its engine loop is down, or once its engine stalled (with the reason). `health`
        stays 200 during a drain (liveness: the process is fine, only leaving)."""
        if self.worker.stall_reason is not None:
            why: dict[str, Any] = {"ready": False, "why": "engine_stalled"}
            if sees_internals(request, internal_token=self.config.internal_token):  # the raw reason: operators only
                why["error"] = self.worker.stall_reason
            return web.json_response(why, status=503)
        if not self.worker.alive:
            return web.json_response({"ready": False, "why": "engine_down"}, status=503)
        if self.draining:
            return web.json_response({"ready": False, "why": "draining"}, status=503)
        return web.json_response({"ready": True})

    async def prometheus(self, request: web.Request) -> web.Response:
        m, engine, role = self.metrics, self.engine, self.config.role
        m.running.labels(role).set(self.worker.num_running)
        m.waiting.labels(role).set(self.worker.num_waiting)
        m.vllm.set_gauges(running=self.worker.num_running, waiting=self.worker.num_waiting,
                          kv_usage_frac=self.worker.num_in_use_blocks / max(1, engine.pool.num_blocks))
        m.engine_busy_seconds.set(self.worker.busy_for_s())
        stats, sched = engine.stats, engine.scheduler
        now = {  # counters since start, read from the engine thread's plain ints
            "hit_tokens": sched.num_prefix_hit_tokens, "computed_tokens": stats.computed_prefill_tokens,
            "preemptions": stats.preemptions, "prefix_queries": sched.num_prefix_query_tokens,
            "prefix_hits": sched.num_prefix_hit_tokens, "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generated_tokens,
        }
        counters = {"hit_tokens": m.prefix_hit_tokens, "computed_tokens": m.computed_tokens, **m.vllm.counters}
        for name, value in now.items():
            counters[name].inc(value - self._seen.get(name, 0))
            self._seen[name] = value
        for name, value in dataclasses.asdict(self.engine.policies.stats).items():
            counter = self.metrics.long_context.labels(name)
            counter.inc(value - self._long_context_seen.get(name, 0))
            self._long_context_seen[name] = value
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def info(self, request: web.Request) -> web.Response:
        spec = self.engine.spec
        return msgpack_response({
            "role": self.config.role, "node": self.config.name, "model": self.config.model_name,
            "vocab_size": self.engine.model_config.vocab_size, "max_model_len": self.engine.max_model_len,
            "block_size_tokens": spec.block_size_tokens, "spec_fingerprint": spec.fingerprint,
            # what a block holds: one group's layers (a hybrid model has a group of full and one of sliding
            # layers; `ModelConfig.kv_groups`), keyed group by group (`kvstore.block_key.group_key`)
            "kv_block_groups": [{"layers": list(g.layers), "window": g.window}
                                for g in self.engine.model_config.kv_groups],
            "eos_token_ids": sorted(self.engine.eos_token_ids), "attention_backend": self.engine.attention_backend,
            "cuda_graph_batch_sizes": list(self.engine.cuda_graph_sizes),
        })

    async def kv_events(self, request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "0"))
            wait_s = float(request.query.get("wait_s", "0"))
        except ValueError:
            return web.json_response({"error": "after must be an integer and wait_s a number"}, status=400)
        if not 0.0 <= wait_s <= MAX_EVENT_WAIT_S:
            return web.json_response({"error": f"wait_s must be in [0, {MAX_EVENT_WAIT_S:g}]"}, status=400)
        if wait_s > 0:
            await self._wait_for_event(after, wait_s)
        batch = self.events.since(after)
        return msgpack_response({
            "node": self.config.name, "last_seq": batch.last_seq,
            "events": None if batch.events is None else [[e.seq, e.kind, e.key, e.digest] for e in batch.events],
            "snapshot": batch.snapshot, "load": self.load_report(),
        })

    def load_report(self) -> dict[str, Any]:
        """The room and speed the router places requests by (`router.nodes.NodeCapacity`): the device pool's
        16-token blocks (all, and free or evictable now; pool blocks / `BlockSpec.num_groups`), the batch and
        admission limits, and the rates the engine measured (`engine.step_rates`; 0.0 before the first step of a
        kind) with its fitted step cost (`engine.step_rates.StepCost`: ``step_*`` seconds), the bytes of one
        16-token block (all groups) and how fast this node pulls KV from peers (`engine.step_rates.PullRates`:
        fixed seconds plus bytes over bytes per second; 0.0 before the first pull).
        A snapshot read off the engine's thread."""
        engine, rates = self.engine, self.engine.rates
        fixed_s, prefill_token_s, decode_row_s = rates.cost.coefficients
        groups = engine.spec.num_groups  # in 16-token blocks: a hybrid model's token block is one per group
        return {"kv_blocks": engine.pool.num_blocks // groups, "free_blocks": self.worker.num_free_blocks // groups,
                "max_num_seqs": engine.config.max_num_seqs,
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                "prefill_tokens_per_s": rates.prefill_tokens_per_s, "decode_step_s": rates.decode_step_s,
                "step_fixed_s": fixed_s, "step_prefill_token_s": prefill_token_s, "step_decode_row_s": decode_row_s,
                "max_pending_requests": self.config.max_pending_requests,
                "block_bytes": engine.spec.block_bytes * groups,
                "pull_bytes_per_s": self.pull_rates.bytes_per_s, "pull_fixed_s": self.pull_rates.fixed_s}

    async def _wait_for_event(self, after: int, wait_s: float) -> None:
        """Return when the log has an event past ``after``, or after ``wait_s``."""
        loop, arrived = asyncio.get_running_loop(), asyncio.Event()

        def notify() -> None:
            loop.call_soon_threadsafe(arrived.set)

        if not self.events.notify_after(after, notify):
            return
        try:
            await asyncio.wait_for(arrived.wait(), wait_s)
        except TimeoutError:
            pass
        finally:
            self.events.cancel(notify)


def msgpack_response(obj: object, status: int = 200, *, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=pack(obj), status=status, content_type="application/msgpack", headers=headers)
