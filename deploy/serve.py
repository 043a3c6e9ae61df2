"""Run one role (router, prefill or decode node) from a loaded `Config`, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from aiohttp import web
from kvrelay.deploy.config import for_node
from kvrelay.deploy.cpu_budget import CoreLending, apply_cpus, format_cpus
from kvrelay.deploy.gpu_memory import GpuUse, activation_reserve_bytes, ignored_on_cpu
from kvrelay.deploy.http_edge import EdgeLimits, EdgeRunner, admitted_requests_cap, edge_limits, raise_fd_limit
from kvrelay.deploy.memory import format_bytes, free_host_bytes
from prometheus_client import CollectorRegistry

if TYPE_CHECKING:  # engine nodes import these where they are built: the router process loads no torch
    from kvrelay.engine.engine import LLMEngine
    from kvrelay.engine.worker import CallerThreadHost
    from kvrelay.node.tracing import Tracing

log = logging.getLogger(__name__)
ROLES = ("router", "prefill", "decode")
ENGINE_DIED_EXIT = 3  # a node's exit code when its engine loop died (`kvrelay up` restarts it)
ENGINE_STALLED_EXIT = 4  # ... when its engine thread was stuck past engine.stall_timeout_s (restarted too)


def node_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def _reachable(bind: str) -> str:
    """An address to reach a node listening on ``bind`` from this machine."""
    return "127.0.0.1" if bind in ("0.0.0.0", "") else bind


def node_urls(config: Any, role: str) -> tuple[str, ...]:
    """The fixed URLs the router reaches ``role``'s nodes at: ``router.<role>_urls``, else (with no
    ``router.<role>_dns`` either) this machine's ``<role>.ports``. Decode nodes accept KV handles only
    from these prefill URLs and the addresses of ``router.prefill_dns`` (the router writes the URL it
    reached the prefill node at into each handle it forwards)."""
    r = config.router
    given, dns = (r.prefill_urls, r.prefill_dns) if role == "prefill" else (r.decode_urls, r.decode_dns)
    if given or dns:
        return given
    ports = config.prefill.ports if role == "prefill" else config.decode.ports
    return tuple(node_url(_reachable(config.internal.bind), p) for p in ports)


def use_triton_interpreter(backend: str | None, device: str) -> None:
    """The ``triton`` attention backend on a CPU device runs under Triton's interpreter (slow; how tests run
    the kernels a GPU runs): set ``TRITON_INTERPRET=1`` before the kernels are imported. No-op otherwise.

    Raises:
        ValueError: the kernels were imported already without it (set TRITON_INTERPRET=1 at start).
    """
    if backend != "triton" or device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:  # Triton reads the variable when it is imported
        raise ValueError("attention_backend triton on CPU needs TRITON_INTERPRET=1 before Triton is imported; "
                         "set it in the environment")
    os.environ["TRITON_INTERPRET"] = "1"


def build_engine(config: Any, *, node_name: str, registry: CollectorRegistry,
                 memory_budget_bytes: int | None = None) -> LLMEngine:
    """The engine of one prefill or decode node: model from ``config.model`` (``model.path`` a local directory:
    `deploy.model_source.resolve_config_model` ran before), tiers from ``config.kvstore``.

    ``model.device`` ``auto`` is decided here, in the node (`model.device.resolve_device`). Each node keeps its
    disk tier in its own subdirectory (``disk.path/<node name>``): LMDB environments are one per process. A tier
    sized by ``fraction_of_free`` takes its share of ``memory_budget_bytes`` (this node's share of the host memory
    free when the deployment started; None: what is free now), or of free GPU memory on CUDA; on CUDA a
    ``gpu_memory_utilization`` is applied to the GPU's total memory once the weights are loaded
    (`deploy.gpu_memory`). The sizes chosen are logged, and a ``gpu_memory_utilization`` ignored on a CPU device
    is said so.

    Raises:
        ConfigError: a device tier that cannot be sized (naming its key); ValueError: a bad device name.
    """
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.device import resolve_device
    from kvrelay.model.loader import load_model

    m = config.model
    device = resolve_device(m.device)
    use_triton_interpreter(config.engine.attention_backend, device)
    loaded = load_model(m.path, dtype=m.dtype, device=device)
    spec = LLMEngine.block_spec_for(loaded, config.kvstore.block_size_tokens, kv_dtype=config.kvstore.dtype)
    budget = (lambda: memory_budget_bytes) if memory_budget_bytes is not None else free_host_bytes
    kv = for_node(config.kvstore, node_name)
    e = config.engine
    gpu_use = (_gpu_use(loaded, device, max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs)
               if kv.device.gpu_memory_utilization is not None and device.startswith("cuda") else None)
    note = ignored_on_cpu(kv.device.gpu_memory_utilization, device, kv.device.fraction(device))
    if note is not None:
        log.warning("%s: %s", node_name, note)
    store_config = kv.store_config(spec, device=device, host_free_bytes=budget, gpu_use=gpu_use)
    log.info("%s KV on %s: device tier %s (%d blocks of %d bytes: %d tokens, %s), host tier %s (%d blocks, %s)",
             node_name, device, format_bytes(store_config.num_device_blocks * spec.block_bytes),
             store_config.num_device_blocks, spec.block_bytes, store_config.num_device_blocks * spec.block_size_tokens,
             _sizing(kv.device.fraction(device), "GPU memory" if device.startswith("cuda") else "host memory",
                     memory_budget_bytes, gpu_use=gpu_use, utilization=kv.device.gpu_memory_utilization),
             format_bytes(store_config.num_host_blocks * spec.block_bytes), store_config.num_host_blocks,
             _sizing(kv.host.free_memory_frac if kv.host else None, "host memory", memory_budget_bytes)
             if kv.host else "none")
    return LLMEngine(loaded, EngineConfig(  # the layout is ``spec``, built once above
        num_blocks=store_config.num_device_blocks, max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens, prefill_packing=e.prefill_packing,
        kernel_plan=e.kernel_plan, deterministic=e.deterministic, max_model_len=e.max_model_len,
        enable_prefix_caching=e.enable_prefix_caching, long_context=config.decode.long_context,
        attention_backend=e.attention_backend, cuda_graphs=e.cuda_graphs,
        cuda_graph_batch_sizes=e.cuda_graph_batch_sizes, grammar_compile_timeout_s=e.grammar_compile_timeout_s,
    ), spec=spec, store_config=store_config, registry=registry)


def _gpu_use(loaded: Any, device: str, *, max_num_batched_tokens: int, max_num_seqs: int) -> GpuUse:
    """This node's GPU readings after its weights loaded: the device's free and total memory (CUDA's own
    ``mem_get_info`` for ``device``), the bytes of the parameters and buffers, and the activation reserve."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    tensors = {t.data_ptr(): t.numel() * t.element_size()
               for t in (*loaded.model.parameters(), *loaded.model.buffers()) if t.device.type == "cuda"}
    c = loaded.config
    mlp_width = max(c.intermediate_size, c.moe.intermediate_size * c.moe.top_k if c.moe is not None else 0)
    dtype_bytes = next(loaded.model.parameters()).element_size()
    activations = activation_reserve_bytes(
        hidden=c.hidden_size, mlp_width=mlp_width,
        qkv_width=(c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, vocab=c.vocab_size,
        dtype_bytes=dtype_bytes, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    return GpuUse(total_bytes=int(total), free_bytes=int(free), weights_bytes=sum(tensors.values()),
                  activation_bytes=activations)


def build_app(config: Any, role: str, index: int, *, name: str | None = None,
              worker_host: CallerThreadHost | None = None, cores: CoreLending | None = None,
              memory_budget_bytes: int | None = None) -> tuple[web.Application, str, int]:
    """The aiohttp app of ``role`` number ``index`` and the (host, port) it listens on. ``name`` is the
    node's identity (NIXL agent name, disk tier subdirectory, logs; default ``<role>-<index>``). An engine node's
    loop runs on ``worker_host``'s thread when given, else on a thread of its own.

    Raises:
        ValueError: unknown role, or an index past the configured nodes.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; use one of {ROLES}")
    internal = config.internal
    from kvrelay.node.tracing import Tracing  # torch-free

    name = name or f"{role}-{index}"
    # one per process; flushed by the app's cleanup, after a planned stop's drain (`_serve`)
    tracing = Tracing.to_endpoint(config.observability.otlp_endpoint, service=f"kvrelay-{role}", instance=name)
    if role == "router":
        from kvrelay.router.app import Router, RouterConfig
        from kvrelay.router.compile_budget import CompileBudgetConfig
        from kvrelay.router.grammar_limits import GrammarLimits

        r = config.router
        router = Router(RouterConfig(
            model_name=config.model.name, model_dir=config.model.path,
            prefill_urls=node_urls(config, "prefill"), decode_urls=node_urls(config, "decode"),
            host=r.host, port=r.port, api_keys=r.api_keys, max_body_bytes=r.max_body_bytes,
            request_timeout_s=r.request_timeout_s, max_n=r.max_n, internal_token=internal.token,
            load_weight_tokens=r.load_weight_tokens, long_context=config.decode.long_context,
            max_concurrent_requests=_admitted_cap(config), max_connections_per_node=r.max_connections_per_node,
            connect_timeout_s=r.connect_timeout_s, node_keepalive_timeout_s=internal.keepalive_timeout_s,
            prefill_dns=r.prefill_dns, decode_dns=r.decode_dns,
            dns_interval_s=r.dns_interval_s, max_queued_requests=r.max_queued_requests,
            max_queued_bytes=r.max_queued_bytes, queue_timeout_s=r.queue_timeout_s,
            decode_reserve_tokens=r.decode_reserve_tokens, migration_limit=r.migration_limit,
            body_read_timeout_s=r.body_read_timeout_s, max_buffered_body_bytes=r.max_buffered_body_bytes,
            write_stall_timeout_s=r.write_stall_timeout_s, disaggregation=r.disaggregation,
            tpot_slo_s=r.tpot_slo_s, ttft_slo_s=r.ttft_slo_s,
            tool_call_parser=r.tool_call_parser, enable_auto_tool_choice=r.enable_auto_tool_choice,
            reasoning_parser=r.reasoning_parser, chat_template=r.chat_template,
            return_tokens_as_token_ids=r.return_tokens_as_token_ids, generation_config=r.generation_config,
            grammar_limits=GrammarLimits(r.max_grammar_bytes, r.max_grammar_nesting, r.max_grammar_rules,
                                         r.max_grammar_alternatives),
            compile_budget=CompileBudgetConfig(r.max_compiling_requests_per_tenant, r.compile_budget_s,
                                               r.compile_budget_window_s),
        ), tracing=tracing)
        return _flushed(router.make_app(), tracing), r.host, r.port
    from kvrelay.engine.worker import EngineWorker
    from kvrelay.node.app import NodeConfig, NodeMetrics

    ports = config.prefill.ports if role == "prefill" else config.decode.ports
    if not 0 <= index < len(ports):
        raise ValueError(f"{role}.ports has {len(ports)} entries; --index {index} is out of range")
    port = ports[index]
    metrics = NodeMetrics(role, model_name=config.model.name, node=name)
    if cores is not None:
        metrics.watch_cpus(cores)
    engine = build_engine(config, node_name=name, registry=metrics.registry, memory_budget_bytes=memory_budget_bytes)
    section = config.prefill if role == "prefill" else config.decode
    node = NodeConfig(role=role, name=name, model_name=config.model.name, host=internal.bind, port=port,
                      max_pending_requests=section.max_pending_requests, internal_token=internal.token,
                      cpus=tuple(cores.home) if cores is not None else (),
                      stall_timeout_s=config.engine.stall_timeout_s,
                      persist_timeout_s=internal.persist_timeout_s)
    worker = EngineWorker(engine, host=worker_host, cores=cores,
                          pool_call_timeout_s=config.engine.pool_call_timeout_s)
    from kvrelay.transfer.config import TransferConfig
    from kvrelay.transfer.node_agent import advertised_host, restrict_transfer_to

    restrict_transfer_to(internal.bind)  # before the NIXL agent exists

    transfer_config = TransferConfig(agent_name=name, lease_ttl_s=config.prefill.lease_ttl_s,
                                     internal_token=internal.token,
                                     node_keepalive_s=internal.keepalive_timeout_s)
    from kvrelay.decode.config import DecodeConfig

    decode_config = DecodeConfig(config.decode.on_transfer_failure, config.decode.transfer_timeout_s,
                                 allowed_owners=frozenset(node_urls(config, "prefill")),
                                 owner_dns=config.router.prefill_dns,
                                 write_stall_timeout_s=config.decode.write_stall_timeout_s)
    if role == "prefill":
        from kvrelay.prefill.kv_publish import PrefillTransfer
        from kvrelay.prefill.service import PrefillService, WholeRequestPrefillService

        owner = PrefillTransfer(worker, transfer_config, owner_url=node_url(advertised_host(internal.bind), port))
        if config.prefill.serve_whole_requests:
            app = WholeRequestPrefillService(node, decode_config, worker, publish=owner.publish,
                                             release=owner.release, metrics=metrics, tracing=tracing).make_app()
        else:
            app = PrefillService(node, worker, publish=owner.publish, release=owner.release, metrics=metrics,
                                 tracing=tracing).make_app()
        owner.install(app)
        return _flushed(app, tracing), internal.bind, port
    from kvrelay.decode.kv_pull import DecodeTransfer
    from kvrelay.decode.service import DecodeService

    reader = DecodeTransfer(worker, transfer_config)
    service = DecodeService(node, decode_config, worker, pull=reader.pull, metrics=metrics, tracing=tracing)
    app = service.make_app()
    reader.install(app)
    return _flushed(app, tracing), internal.bind, port


def _edge(config: Any, role: str) -> EdgeLimits:
    """``role``'s HTTP edge limits (`deploy.http_edge`) against this process's open-file limit, raised first."""
    section, prefix = (config.router, "router") if role == "router" else (config.internal, "internal")
    return edge_limits(header_read_timeout_s=section.header_read_timeout_s,
                       max_open_connections=section.max_open_connections, fd_limit=raise_fd_limit(),
                       key_prefix=prefix)


def edge_problem(config: Any, role: str) -> str | None:
    """Why ``role`` cannot start with its ``max_open_connections`` at this process's open-file limit (raised to the
    hard one first), or None."""
    try:
        _edge(config, role)
    except ValueError as exc:
        return str(exc)
    return None


def _admitted_cap(config: Any) -> int:
    """``router.max_concurrent_requests``, lowered to what the descriptors left after client connections carry."""
    fd_limit = raise_fd_limit()
    return admitted_requests_cap(config.router.max_concurrent_requests, limits=_edge(config, "router"),
                                 fd_limit=fd_limit)


def _flushed(app: web.Application, tracing: Tracing) -> web.Application:
    """``app``, whose cleanup (after a planned stop's drain) flushes ``tracing``'s queued spans (`node.tracing`)."""
    async def flush(app: web.Application) -> None:
        await tracing.aclose()

    app.on_cleanup.append(flush)
    return app


def run_role(config: Any, role: str, index: int = 0, *, name: str | None = None, cpus: list[int] | None = None,
             cpu_pool: list[int] | None = None, cpu_lock_dir: str | None = None,
             memory_budget_bytes: int | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code.

    An engine node pins itself to ``cpus`` (None: every CPU it may run on), sizes torch's threads to
    them (`deploy.cpu_budget`), and runs its engine on this (the main) thread and its event loop on
    another (see `engine.worker.CallerThreadHost` for why).
    """
    name = name or f"{role}-{index}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    if role == "router":
        limits = _edge(config, role)
        log.info("%s: open-file limit %d; at most %d open client connections, headers within %g s",
                 name, raise_fd_limit(), limits.max_open_connections, limits.header_read_timeout_s)
        app, host, port = build_app(config, role, index, name=name)
        asyncio.run(_serve(app, host, port, name=name, access_log=True, stop=_Stop(),
                           keepalive_timeout_s=config.router.keepalive_timeout_s, limits=limits))
        return 0
    cores: CoreLending | None = None
    if cpu_pool is not None and cpu_lock_dir is not None and cpus is not None:
        apply_cpus(cpu_pool, threads=len(cpus))
        cores = CoreLending(cpu_lock_dir, cpus, cpu_pool)
        log.info("%s owns CPUs %s and borrows idle ones of %s", name, format_cpus(cpus),
                 format_cpus(cpu_pool))
    else:
        log.info("%s runs on CPUs %s", name, format_cpus(apply_cpus(cpus)))
    limits = _edge(config, role)  # refuses a max_open_connections that does not fit, before the model loads
    from kvrelay.engine.worker import CallerThreadHost

    worker_host = CallerThreadHost()
    app, host, port = build_app(config, role, index, name=name, worker_host=worker_host, cores=cores,
                                memory_budget_bytes=memory_budget_bytes)
    from kvrelay.node.app_keys import ENGINE_STALLED

    app[ENGINE_STALLED] = _exit_stalled
    stop = _Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    failures: list[BaseException] = []

    def loop_thread() -> None:
        try:
            # Nodes answer the router's event polls: no access log for those.
            asyncio.run(_serve(app, host, port, name=name, access_log=False, stop=stop,
                               drain_timeout_s=config.internal.drain_timeout_s,
                               keepalive_timeout_s=config.internal.keepalive_timeout_s, limits=limits))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            failures.append(exc)

    thread = threading.Thread(target=loop_thread, name="event-loop")
    thread.start()
    try:
        worker_host.serve(keep_waiting=thread.is_alive)  # returns when the server stops the engine
    except BaseException:  # noqa: BLE001 - the engine loop died (it failed its requests and logged why)
        # Stop serving and exit non-zero, so that `kvrelay up` (or the pod's restart policy) starts a
        # fresh node rather than keeping one that can only answer 503.
        stop.set()
        thread.join()
        return ENGINE_DIED_EXIT
    thread.join()
    if failures:
        raise failures[0]
    return 0


def _exit_stalled(reason: str) -> None:
    """The node gave its stuck engine up (`node.app.EngineNode`): exit now, non-zero, so that `kvrelay up`
    (or the pod's restart policy) starts a fresh node. Not a clean stop: the main thread is stuck in the
    engine, so nothing can be joined or closed; LMDB keeps what it committed."""
    log.critical("%s: exiting with code %d", reason, ENGINE_STALLED_EXIT)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(ENGINE_STALLED_EXIT)


def _sizing(frac: float | None, memory: str, budget: int | None, *, gpu_use: GpuUse | None = None,
            utilization: float | None = None) -> str:
    """How a tier was sized, for the start-up line."""
    if gpu_use is not None and utilization is not None:
        return (f"gpu_memory_utilization {utilization:g} of {format_bytes(gpu_use.total_bytes)} less the weights "
                f"({format_bytes(gpu_use.weights_bytes)}) and the activation reserve "
                f"({format_bytes(gpu_use.activation_bytes)})")
    if frac is None:
        return "configured bytes"
    of = f"this node's share ({format_bytes(budget)}) of the {memory} free at start" if budget is not None and \
        memory == "host memory" else f"the {memory} free at start"
    return f"fraction_of_free {frac:g} of {of}"


class _Stop:
    """Set from a signal handler on any thread; awaited by the event loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._requested = False

    def set(self) -> None:
        self._requested = True
        loop, event = self._loop, self._event
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        event = asyncio.Event()
        self._event = event
        self._loop = asyncio.get_running_loop()
        if self._requested:  # asked before the loop was known (or while it was being published)
            event.set()
        await event.wait()


async def _serve(app: web.Application, host: str, port: int, *, name: str, access_log: bool, stop: _Stop,
                 limits: EdgeLimits, drain_timeout_s: float = 0.0, keepalive_timeout_s: float = 75.0) -> None:
    """Serve ``app`` until ``stop``, drain it (an engine node: `node.app.EngineNode.drain`), then run its
    cleanup (which stops an engine node's worker); the cleanup runs however this ends. An idle keep-alive
    connection is closed after ``keepalive_timeout_s`` (aiohttp's own default is an hour); headers and open
    connections are bounded by ``limits`` (`deploy.http_edge`)."""
    runner = EdgeRunner(app, limits=limits, handler_cancellation=True, access_log=log if access_log else None,
                        keepalive_timeout=keepalive_timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("%s listening on http://%s:%d", name, host, port)
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("%s stopping", name)
        from kvrelay.node.app_keys import DRAIN  # torch-free

        drain = app.get(DRAIN)
        if drain is not None:
            await drain(drain_timeout_s)
    finally:
        await runner.cleanup()
