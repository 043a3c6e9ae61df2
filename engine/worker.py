"""`EngineWorker`: one `LLMEngine` on its own thread, driven from asyncio.

The engine and its `BlockPool` are touched only by the worker thread. Callers on the event loop
submit requests and read their outputs from an async iterator, or run a function on the worker
thread between two steps: `call` (skipped if its caller stopped waiting before it started: for
functions that take blocks or only read) or `must_run` (runs however long the caller waited: for
functions that give blocks back). Commands run in the order they were queued.

    worker = EngineWorker(engine); worker.start()
    stream = worker.submit("r1", prompt_ids, params)
    async for out in stream: ...
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvrelay.engine import step_isolation
from kvrelay.engine.engine import LLMEngine, RequestError, StepOutput
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.model.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
FinishHook = Callable[[LLMEngine, str], None]


class EngineFailure(RuntimeError):
    """The request cannot go on: its engine step raised (alone: `engine.step_isolation`), its loop died, or
    the node cut the request off while stopping. ``status`` is the HTTP status a node answers with (500: the
    engine failed on this request, which a retry elsewhere would not mend; 503: the node is going away, or
    its loop died, so another node may serve a retry)."""

    def __init__(self, message: str, *, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class EngineTimes:
    """When one request's steps ran, as `time.time_ns()` stamps (0: not yet), for its node's timings and trace
    spans (`node.tracing`). Written once each by the worker thread; read on the event loop after an output that
    follows the stamp (outputs reach the loop after the step that stamped them)::

        scheduled_ns        start of the first step that ran any of it (a prefill chunk, or its first decode)
        first_output_ns     end of the step that gave its first output (its first token, or a refusal)
        finished_ns         end of the step after which every sample had finished (before the finish hook)
    """

    scheduled_ns: int = 0
    first_output_ns: int = 0
    finished_ns: int = 0


@dataclass(eq=False)
class RequestStream:
    """Outputs of one request; iterate with ``async for``. Ends when every sample has finished. ``times``:
    when its steps ran (`EngineTimes`).

    Raises (while iterating):
        RequestError: the engine refused the request.
        EngineFailure: the engine failed mid-step.
    """

    request_id: str
    num_samples: int
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    times: EngineTimes = field(default_factory=EngineTimes)
    _remaining: int = 0

    def __post_init__(self) -> None:
        self._remaining = self.num_samples

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StepOutput]:
        while self._remaining > 0:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._remaining -= 1
            yield item


@dataclass(frozen=True, slots=True)
class _Submit:
    stream: RequestStream
    prompt: list[int]
    params: SamplingParams
    salt: bytes
    first_token_ids: list[int] | None
    resume_token_ids: list[list[int] | None] | None
    pinned_block_ids: list[int]
    on_finish: FinishHook | None
    long_context: LongContextConfig | None = None
    block_keys: list[BlockKey] | None = None


@dataclass(frozen=True, slots=True)
class _Command:
    """Work for the worker thread. ``refuse(exc)`` is called instead of ``run()`` when the loop is gone
    (any thread may call it), so that nobody waits on a command that will never run."""

    run: Callable[[], None]
    refuse: Callable[[BaseException], None] | None = None


class StepCores(Protocol):
    """Which CPUs the engine may compute on, step by step (`deploy.cpu_budget.CoreLending`)."""

    def before_step(self) -> int:
        """Called before each step; may block until the node's own CPUs are free; returns threads."""

    def after_step(self) -> None:
        """Called after each step, also one that raised."""

    def idle(self) -> None:
        """Called when the engine has nothing left to compute."""


class CallerThreadHost:
    """Runs a worker's loop on the thread that calls `serve` instead of a thread of its own.

    A server gives its main thread to the engine and runs the event loop on another: torch's OpenMP
    matmuls run about twice as fast on the main thread as on a thread started after the main thread
    used them (a bf16 576×1536 matmul of 16 rows here: 66 µs vs 120 µs; a 16-sequence decode step
    39 ms vs 76 ms).
    """

    def __init__(self) -> None:
        self._targets: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def start(self, target: Callable[[], None]) -> None:
        """Hand over the worker's loop (any thread)."""
        self._targets.put(target)

    def serve(self, *, keep_waiting: Callable[[], bool]) -> None:
        """Run the loop handed to `start` until the worker stops; return early if nothing was handed over
        while ``keep_waiting()`` is still true."""
        while True:
            try:
                target = self._targets.get(timeout=0.5)
            except queue.Empty:
                if not keep_waiting():
                    return
                continue
            target()
            return


class EngineWorker:
    """Runs ``engine`` on a thread of its own, or on a `CallerThreadHost`'s thread. ``after_step(engine)``
    runs on that thread after each step. ``pool_call_timeout_s``: how long `call` and `must_run` wait when
    their caller gives no ``timeout_s``."""

    def __init__(self, engine: LLMEngine, *, after_step: Callable[[LLMEngine], None] | None = None,
                 host: CallerThreadHost | None = None, cores: StepCores | None = None,
                 pool_call_timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.pool_call_timeout_s = pool_call_timeout_s
        self._cores = cores
        self._after_step = after_step
        self._host = host
        self._stopped = threading.Event()  # set when the loop has returned
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched on the worker thread only
        self._finish_hooks: dict[str, FinishHook] = {}
        self._unfinished: dict[str, int] = {}  # samples of each request still to finish
        self._unscheduled: dict[str, RequestStream] = {}  # added, no step has run them yet (`EngineTimes`)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Outputs of the current pass, handed to the event loop in one call (`_flush`): one wake-up of the
        # event loop a step instead of one per token.
        self._outbox: list[tuple[RequestStream, StepOutput | BaseException]] = []  # worker thread only
        self.failure: str | None = None  # why the loop died (set once, on its thread); /health reports it
        # Why the loop was given up as stuck (`give_up`; set once, by the node's watchdog on the event loop).
        self.stall_reason: str | None = None
        # time.monotonic() when the loop began its current pass of work (commands, a step); None while it
        # waits for work. Written by the worker thread, read anywhere (`busy_for_s`).
        self.busy_since_s: float | None = None
        self.num_running = 0  # written by the worker thread, read anywhere (a snapshot for load reports)
        self.num_waiting = 0
        self.num_free_blocks = engine.pool.num_free_blocks
        self.num_in_use_blocks = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the loop (on its own thread, or hand it to the host); call from the event loop that will
        consume outputs."""
        self._loop = asyncio.get_running_loop()
        if self._host is not None:
            self._host.start(self._run)
            return
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the loop, then close the engine (commits queued disk writes)."""
        self._commands.put(None)  # not `_put`: a stop is never refused
        if self._thread is not None or self._host is not None:
            await asyncio.to_thread(self._stopped.wait, 10.0)
        await asyncio.to_thread(self.engine.close)

    # ------------------------------------------------------------------ API
    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        salt: bytes = b"",
        first_token_ids: Sequence[int] | None = None,
        resume_token_ids: Sequence[Sequence[int] | None] | None = None,
        pinned_block_ids: Sequence[int] = (),
        on_finish: FinishHook | None = None,
        long_context: LongContextConfig | None = None,
        block_keys: Sequence[BlockKey] | None = None,
    ) -> RequestStream:
        """Queue a request (see `LLMEngine.add_request`). ``on_finish(engine, request_id)`` runs on the
        worker thread right after the step that finishes the request, before any other step and
        before the stream yields its last output."""
        stream = RequestStream(request_id, params.n)
        cmd = _Submit(stream, list(prompt), params, salt, None if first_token_ids is None else list(first_token_ids),
                      None if resume_token_ids is None else [None if t is None else list(t) for t in resume_token_ids],
                      list(pinned_block_ids), on_finish, long_context,
                      None if block_keys is None else list(block_keys))
        assert self._loop is not None, "EngineWorker.start() was not called"
        loop = self._loop
        self._put(_Command(lambda: self._do_submit(cmd),
                           lambda exc: loop.call_soon_threadsafe(stream._queue.put_nowait, exc)))
        return stream

    def abort(self, request_id: str) -> None:
        """End a request now (client gone); its blocks go back to the pool. Unknown ids are ignored."""
        self._put(_Command(lambda: self._do_abort(request_id)))

    async def cut_off(self, message: str) -> int:
        """End every request in the engine now with ``EngineFailure(message, status=503)`` (a stopping
        node whose drain ran out of time); their blocks go back to the pool. Returns how many."""
        def fail(engine: LLMEngine) -> int:
            n = len(self._streams)
            self._fail_all(EngineFailure(message, status=503))
            return n

        return await self.call(fail)

    async def call(self, fn: Callable[[LLMEngine], T], *, timeout_s: float | None = None) -> T:
        """Run ``fn(engine)`` on the worker thread between steps and return its result (or raise its error).

        If the caller stops waiting (``timeout_s``, cancellation) before ``fn`` starts, ``fn`` never runs,
        so a call that takes blocks cannot take them for nobody. A function that gives blocks back goes
        through `must_run` instead: skipped, its blocks would be lost for good.

        Raises:
            TimeoutError: ``fn`` did not finish within ``timeout_s`` (it will not start after that).
            EngineFailure: (503) the loop is gone or was given up (`give_up`).
        """
        fut = self._future()

        def run() -> None:
            if fut.done():  # the caller stopped waiting (timeout, cancellation): do not act for nobody
                return
            self._run_into(fut, fn)

        self._put(_Command(run, self._refuser(fut)))
        return await asyncio.wait_for(fut, self.pool_call_timeout_s if timeout_s is None else timeout_s)

    async def must_run(self, fn: Callable[[LLMEngine], T], *, timeout_s: float | None = None) -> T:
        """Run ``fn(engine)`` on the worker thread between steps, even if the caller stops waiting
        (``timeout_s``, cancellation) first: for functions that give blocks back (lease releases, frees of
        blocks, keying blocks read for a pull), which a skip would lose for good. It runs once, in queue
        order; the caller gets its result (or error) if still waiting.

        Raises:
            TimeoutError: ``fn`` did not finish within ``timeout_s`` (it still runs, later).
            EngineFailure: (503) the loop is gone or was given up: ``fn`` never runs (the pools went with it).
        """
        fut = self._future()
        self._put(_Command(lambda: self._run_into(fut, fn), self._refuser(fut)))
        return await asyncio.wait_for(fut, self.pool_call_timeout_s if timeout_s is None else timeout_s)

    def _future(self) -> asyncio.Future:
        assert self._loop is not None, "EngineWorker.start() was not called"
        return self._loop.create_future()

    def _run_into(self, fut: asyncio.Future, fn: Callable[[LLMEngine], Any]) -> None:
        """On the worker thread: run ``fn`` and hand its result or error to ``fut`` (dropped if nobody waits)."""
        assert self._loop is not None
        try:
            result: Any = fn(self.engine)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._loop.call_soon_threadsafe(_set_exception, fut, exc)
        else:
            self._loop.call_soon_threadsafe(_set_result, fut, result)

    def _refuser(self, fut: asyncio.Future) -> Callable[[BaseException], None]:
        loop = self._loop
        assert loop is not None
        return lambda exc: loop.call_soon_threadsafe(_set_exception, fut, exc)

    # ------------------------------------------------------------- stalls
    def busy_for_s(self) -> float:
        """How long the loop has been in its current pass of work (commands, a step); 0.0 while it waits
        for work (idle, or waiting for blocks that leases or pulls hold). Any thread."""
        since = self.busy_since_s
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def give_up(self, reason: str) -> int:
        """Give the loop up as stuck in a pass (the node's watchdog, `node.app.EngineNode`); call on the
        event loop's thread. Every request in the engine, every queued command and everything submitted
        later ends now with ``EngineFailure(reason, status=503)`` (a retry may go to another node), and
        `alive` turns False. Nothing can stop the stuck thread: should it come back, its loop ends its
        requests (freeing their blocks) and returns. Returns how many requests it ended.
        """
        self.stall_reason = reason
        exc = EngineFailure(reason, status=503)
        streams = list(self._streams.values())  # the worker thread's dict, read while that thread is stuck
        for stream in streams:
            stream._queue.put_nowait(exc)
        self._refuse_queued(exc)
        return len(streams)

    def _put(self, cmd: _Command) -> None:
        """Queue ``cmd``; once the loop is gone, refuse it instead. The dying loop refuses what was queued
        before it stopped and this refuses what came after, so every command is run or refused once."""
        self._commands.put(cmd)
        if self._stopped.is_set():
            self._refuse_queued()
        elif self.stall_reason is not None:
            self._refuse_queued(EngineFailure(self.stall_reason, status=503))

    def _refuse_queued(self, exc: EngineFailure | None = None) -> None:
        exc = exc or EngineFailure(f"the engine is not running ({self.failure or 'stopped'})", status=503)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not None and cmd.refuse is not None:
                cmd.refuse(exc)

    # --------------------------------------------------------- worker thread
    def _emit(self, stream: RequestStream, item: StepOutput | BaseException) -> None:
        self._outbox.append((stream, item))

    def _flush(self) -> None:
        if self._outbox:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_deliver_all, self._outbox)
            self._outbox = []

    def _do_submit(self, cmd: _Submit) -> None:
        rid = cmd.stream.request_id
        try:
            self.engine.add_request(rid, cmd.prompt, cmd.params, salt=cmd.salt,
                                    first_token_ids=cmd.first_token_ids, resume_token_ids=cmd.resume_token_ids,
                                    pinned_block_ids=cmd.pinned_block_ids,
                                    long_context=cmd.long_context, block_keys=cmd.block_keys)
        except (RequestError, ValueError) as exc:  # ValueError: the caller's block keys do not fit (a bug)
            if cmd.pinned_block_ids:
                self.engine.pool.release(cmd.pinned_block_ids)
            self._emit(cmd.stream, exc if isinstance(exc, RequestError) else EngineFailure(str(exc)))
            return
        self._streams[rid] = cmd.stream
        self._unscheduled[rid] = cmd.stream
        self._unfinished[rid] = cmd.params.n
        if cmd.on_finish is not None:
            self._finish_hooks[rid] = cmd.on_finish

    def _do_abort(self, request_id: str) -> None:
        for out in self.engine.abort_request(request_id):
            self._deliver(out)

    def _stamp(self, outputs: list[StepOutput], step_ns: int, end_ns: int) -> None:
        """Stamp `EngineTimes` of the requests the step from ``step_ns`` to ``end_ns`` ran: those that got an
        output, and (while some request waits for its first step) those now running (a prefill chunk gives
        no output)."""
        unscheduled = self._unscheduled
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            times = stream.times
            if not times.first_output_ns:
                times.first_output_ns = end_ns
            if not times.scheduled_ns:
                times.scheduled_ns = step_ns
                unscheduled.pop(out.request_id, None)
        if unscheduled:
            for seq in self.engine.scheduler.running:
                stream = unscheduled.pop(seq.request_id, None)
                if stream is not None:
                    stream.times.scheduled_ns = step_ns

    def _deliver(self, out: StepOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            self._unfinished[out.request_id] -= 1
        if out.finished and self._unfinished[out.request_id] == 0:
            del self._unfinished[out.request_id]
            del self._streams[out.request_id]
            self._unscheduled.pop(out.request_id, None)
            stream.times.finished_ns = time.time_ns()
            hook = self._finish_hooks.pop(out.request_id, None)
            if hook is not None and out.finish_reason != "abort":  # before the last output: the caller sees it
                try:
                    hook(self.engine, out.request_id)
                except Exception as exc:  # noqa: BLE001 - reported to that request alone
                    log.exception("finish hook of %s failed", out.request_id)
                    self._emit(stream, EngineFailure(f"finishing the request failed: {exc}"))
                    return
        self._emit(stream, out)

    def _drain(self, *, wait: bool) -> list[_Command | None]:
        """Every queued command; waits up to 0.5 s for the first one when ``wait``."""
        cmds: list[_Command | None] = []
        try:
            cmds.append(self._commands.get(timeout=0.5) if wait else self._commands.get_nowait())
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            return cmds

    def _run(self) -> None:
        """The loop. If it dies, every request in it ends with `EngineFailure` and every queued or later
        command is refused, then the error propagates (a node's process exits: `deploy.serve.run_role`)."""
        try:
            self._loop_until_stopped()
        except BaseException as exc:
            self.failure = f"the engine loop died: {type(exc).__name__}: {exc}"
            log.critical("%s", self.failure, exc_info=True)
            # 503: the node exits (to be restarted), so its requests may move (a 500 would be theirs alone)
            self._fail_all(EngineFailure(self.failure, status=503))
            self._flush()
            raise
        finally:
            self._stopped.set()
            self._refuse_queued()

    @property
    def alive(self) -> bool:
        """Started, and its loop has neither died, nor been stopped, nor been given up (`give_up`)."""
        return ((self._loop is not None) and self.failure is None and self.stall_reason is None
                and not self._stopped.is_set())

    def _loop_until_stopped(self) -> None:
        while True:
            # A stalled engine waits for blocks that leases or pulls hold: they come back through a command.
            idle = not self.engine.has_unfinished() or self.engine.stalled
            if idle and self._cores is not None:
                self._cores.idle()
            cmds = self._drain(wait=idle)
            self.busy_since_s = time.monotonic()
            for cmd in cmds:
                if cmd is None:
                    self._flush()
                    return
                try:
                    cmd.run()
                except Exception:  # noqa: BLE001 - a failed command must not stop the loop serving the rest
                    log.exception("engine command failed")
            if self.engine.has_unfinished():
                if self._cores is not None:
                    self._cores.before_step()
                step_ns = time.time_ns()
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - a failed step must not take the server down
                    outputs = self._isolate(exc)
                finally:
                    if self._cores is not None:
                        self._cores.after_step()
                self._stamp(outputs, step_ns, time.time_ns())
                for out in outputs:
                    self._deliver(out)
                if self._after_step is not None:
                    self._after_step(self.engine)
            self._flush()
            self._snapshot()
            self.busy_since_s = None
            if self.stall_reason is not None:  # given up while stuck in this pass: end what is left, and stop
                self._fail_all(EngineFailure(self.stall_reason, status=503))
                self._flush()
                self._snapshot()
                return

    def _isolate(self, exc: Exception) -> list[StepOutput]:
        """After a step raised ``exc``: step each request alone (`engine.step_isolation`); those whose step
        raises again end with `EngineFailure` (500, naming the error), the rest go on with the tokens an
        undisturbed run gives. Returns the outputs of the steps taken alone."""
        log.error("engine step failed (%s: %s) with %d requests in the engine; stepping each alone to find the "
                  "one(s) that fail it", type(exc).__name__, exc, len(self._streams), exc_info=exc)
        outputs: list[StepOutput] = []
        for rid in step_isolation.reset(self.engine):
            got, error = step_isolation.try_alone(self.engine, rid)
            outputs.extend(got)
            if error is not None:
                log.error("request %s fails the engine step alone (%s: %s); ending it", rid, type(error).__name__,
                          error, exc_info=error)
                self._fail_one(rid, EngineFailure(f"internal error: the engine step failed on this request "
                                                  f"({type(error).__name__}: {error}); the node serves on"))
        return outputs

    def _fail_one(self, request_id: str, exc: EngineFailure) -> None:
        """End ``request_id`` now with ``exc``; its blocks go back to the pool."""
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - one broken request must not stop the thread serving the rest
            log.exception("aborting request %s after a failed step", request_id)
        self._finish_hooks.pop(request_id, None)
        self._unfinished.pop(request_id, None)
        self._unscheduled.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._emit(stream, exc)

    def _fail_all(self, exc: EngineFailure) -> None:
        for rid in list(self._streams):
            self._fail_one(rid, exc)
        self._finish_hooks.clear()
        self._unfinished.clear()
        self._unscheduled.clear()

    def _snapshot(self) -> None:
        self.num_running = len(self.engine.scheduler.running)
        self.num_waiting = len(self.engine.scheduler.waiting)
        self.num_free_blocks = self.engine.pool.num_free_blocks
        self.num_in_use_blocks = self.engine.pool.stats().num_in_use


def _deliver_all(items: list[tuple[RequestStream, StepOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._queue.put_nowait(item)


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
