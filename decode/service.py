"""The decode service: pulls a request's KV from the prefill node that computed it, joins the
continuous batch and streams tokens back to the router.

    POST /generate   msgpack request (`transfer.wire.GenerationMessage`) → a stream of msgpack frames

A request without a KV handle is prefilled here (aggregated mode, and the recompute fallback). A request
the router moved here mid-stream (`GenerationMessage.resume_token_ids`) continues from the tokens already
sent: the prompt's KV from its handle, this node's cache, or recomputed; the generated tokens' recomputed.

Every answer to a request with a KV handle says whether this node ended the handle's lease
(`transfer.config.LEASE_HEADER`: "ended" once the pull told the owner "done" or "abort"; "open" when it
never reached the owner: a malformed handle, a foreign owner, keys of another prompt, the quarantine
cap, a failed handshake). An open lease is the router's to release; a refusal before the body is read
(429, 503 while draining) carries no header and means the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from kvrelay.decode.config import DecodeConfig
from kvrelay.engine.engine import RequestError
from kvrelay.engine.worker import EngineFailure, EngineWorker
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.node.app import EngineNode, NodeConfig, NodeMetrics, msgpack_response
from kvrelay.node.tracing import Stage, Tracing
from kvrelay.transfer.bounded_write import write_within
from kvrelay.transfer.config import LEASE_HEADER
from kvrelay.transfer.discovery import NodeAddresses
from kvrelay.transfer.errors import TransferError
from kvrelay.transfer.puller import PullResult
from kvrelay.transfer.wire import DecodeFrame, GenerationMessage, encode_error_frame, encode_frame

log = logging.getLogger(__name__)
OWNER_DNS_REFRESH_S = 1.0  # least time between two lookups of the prefill DNS names for an unknown owner

# ``pull(handle: KvHandle, request_id, deadline_s=) -> PullResult`` (its block ids carry one reference each);
# raises `TransferError` on failure.
PullFn = Callable[..., Awaitable[PullResult]]


class DecodeService(EngineNode):
    def __init__(
        self,
        node: NodeConfig,
        config: DecodeConfig,
        worker: EngineWorker,
        *,
        pull: PullFn | None = None,
        metrics: NodeMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__(node, worker, metrics=metrics, tracing=tracing)
        self.decode_config = config
        self._pull = pull
        self._owners = None if config.allowed_owners is None else NodeAddresses(config.allowed_owners,
                                                                                 config.owner_dns)
        self._owners_resolved_at = -OWNER_DNS_REFRESH_S

    def make_app(self, *, client_max_size: int = 64 * 1024 * 1024) -> web.Application:
        app = super().make_app(client_max_size=client_max_size)
        app.router.add_post("/generate", self.generate)
        return app

    async def _check_handle(self, msg: GenerationMessage, keys: list[BlockKey] | None) -> None:
        """A handle may only name the blocks of this request's own prompt and salt (keys this node
        computed), held by a prefill node of this deployment (a configured URL, or an address of the
        prefill DNS names, resolved again at most every OWNER_DNS_REFRESH_S when an owner is not among
        them: a new pod). Raises TransferError before any contact."""
        handle = msg.handle
        assert handle is not None
        owners, url = self._owners, handle.owner_url.rstrip("/")
        if owners is not None and url not in owners.urls:
            now = asyncio.get_running_loop().time()
            if owners.dynamic and now - self._owners_resolved_at >= OWNER_DNS_REFRESH_S:
                self._owners_resolved_at = now
                await owners.refresh()
            if url not in owners.urls:
                raise TransferError("foreign_owner", f"the KV handle names {handle.owner_url[:100]!r}, "
                                                     "which is not a prefill node of this deployment")
        n = len(handle.keys)
        if keys is None or n > len(keys) or list(handle.keys) != keys[:n] or \
                handle.num_tokens != self.engine.spec.tokens_held(n):
            raise TransferError("key_mismatch", "the KV handle's block keys are not those of this request's "
                                                "prompt and salt")

    async def _pinned_blocks(self, msg: GenerationMessage, keys: list[BlockKey] | None) -> _Pulled:
        """Pull the KV of the request's handle (typed at the HTTP edge; a malformed one arrives as
        ``handle_error``). ``block_ids`` None: pulled nothing (recompute). Under ``fail`` a failed pull raises
        its `TransferError` (``lease_ended`` on it); either way the failure is counted under its reason."""
        request_id = msg.request_id
        if msg.handle is None and msg.handle_error is None:
            return _Pulled([], lease_ended=False)
        started_ns = time.time_ns()
        t0 = time.perf_counter()
        deadline_s = self.decode_config.transfer_timeout_s
        # The pull runs as its own task with its own deadline, shielded: a client that goes away mid-pull
        # must not cancel it half way (blocks reserved on the engine thread would leak); its blocks are
        # given back once it ends instead.
        try:
            if self._pull is None:
                raise TransferError("no_agent", "this decode node has no KV transfer agent")
            if msg.handle_error is not None:
                raise TransferError("bad_handle", f"the KV handle is malformed: {msg.handle_error}")
            assert msg.handle is not None  # no handle_error, so there is a handle
            await self._check_handle(msg, keys)
            task = asyncio.ensure_future(self._pull(msg.handle, request_id, deadline_s=deadline_s))
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError:
                task.add_done_callback(self._release_abandoned)
                raise
        except TransferError as exc:
            failure = exc
        except Exception as exc:  # noqa: BLE001 - a bug while pulling: same policy as a transfer failure
            log.exception("request %s: KV pull raised unexpectedly", request_id)
            failure = TransferError("internal", f"{type(exc).__name__}: {exc}")
        else:
            seconds = time.perf_counter() - t0
            self.metrics.transfer_seconds.observe(seconds)
            self.metrics.transfer_bytes.inc(result.bytes_read)
            self.pull_rates.observe(result.bytes_read, seconds)
            return _Pulled(result.block_ids, lease_ended=result.lease_ended,
                           stage=_pull_stage(msg, started_ns, result=result))
        self.metrics.transfer_failures.labels(reason=failure.reason).inc()
        log.warning("request %s: KV pull failed (%s): %s", request_id, failure.reason, failure)
        if self.decode_config.on_transfer_failure == "fail":
            raise failure
        return _Pulled(None, lease_ended=failure.lease_ended, stage=_pull_stage(msg, started_ns,
                                                                                 failure=failure.reason))

    def _release_abandoned(self, task: asyncio.Future) -> None:
        """Give back the blocks of a pull whose request went away while it ran."""
        if task.cancelled() or task.exception() is not None:
            return
        block_ids = task.result().block_ids
        if block_ids:
            asyncio.ensure_future(self.worker.must_run(lambda engine: engine.pool.release(block_ids)))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /generate``. The stream's first frame and its last carry the request's stage timings
        (`DecodeFrame.timings`: ``kv_pull_s``, ``decode_queue_s``, ``first_step_s``; the last also ``stream_s``),
        and with tracing on its spans (``decode.request`` → ``decode.kv_pull``, ``decode.queue``,
        ``decode.first_step``, ``decode.stream``) join the caller's trace."""
        arrived_ns = time.time_ns()
        msg = await self.read_request(request)
        if isinstance(msg, web.Response):
            return msg
        rid, prompt, params, salt, first = msg.request_id, msg.prompt, msg.params, msg.salt, msg.first_token_ids
        try:
            long_context = self.engine.config.long_context.with_overrides(msg.long_context)
            self.engine.check_long_context(long_context)
        except ValueError as exc:
            self.metrics.request_done("bad_request")
            return msgpack_response({"error": str(exc)}, status=400)
        try:
            keys = self.block_keys_of(msg)
            pulled = await self._pinned_blocks(msg, keys)
        except TransferError as exc:
            self.metrics.request_done("transfer_failed")
            self.trace(request, Stage("decode.request", arrived_ns, time.time_ns(), {"request_id": rid}),
                       error=f"KV transfer failed ({exc.reason}): {exc}")
            return msgpack_response({"error": f"KV transfer from the prefill node failed ({exc.reason}): {exc}"},
                                    status=502, headers=_lease_header(exc.lease_ended))
        pinned = pulled.block_ids
        log.info("request %s: joining the batch (%d prompt tokens, %d pulled blocks%s)", rid, len(prompt),
                 len(pinned or []), ", recompute after a failed pull" if pinned is None else "")
        submitted_ns = time.time_ns()
        stream = self.worker.submit(rid, prompt, params, salt=salt, first_token_ids=first,
                                    resume_token_ids=msg.resume_token_ids, pinned_block_ids=pinned or [],
                                    long_context=long_context, block_keys=keys)
        lease = _lease_header(pulled.lease_ended)
        resp = web.StreamResponse(headers={"Content-Type": "application/msgpack", **lease})
        done = False
        stages: list[Stage] = [] if pulled.stage is None else [pulled.stage]
        first, unfinished = True, params.n
        error: str | None = None
        try:
            async for out in stream:
                timings, cached = None, None
                if first:  # the request's first step is over: the stages up to it are known
                    first = False
                    cached = out.num_cached_prompt_tokens
                    stages += _engine_stages(submitted_ns, stream.times.scheduled_ns, stream.times.first_output_ns)
                    timings = _timings(stages)
                if out.finished:
                    unfinished -= 1
                if not unfinished:  # the last frame: the stream's own time too
                    stages.append(Stage("decode.stream", stream.times.first_output_ns, time.time_ns()))
                    timings = _timings(stages)
                await self._write(request, resp, encode_frame(DecodeFrame(
                    out.index, out.new_token_ids, out.finished, out.finish_reason, out.logprobs, timings, cached)))
            done = True
        except RequestError as exc:
            error = str(exc)
            self.metrics.request_done("bad_request")
            if not resp.prepared:
                return msgpack_response({"error": str(exc)}, status=400, headers=lease)
            await self._write_last(request, resp, encode_error_frame(str(exc), 400), rid)
            return resp
        except EngineFailure as exc:
            error = str(exc)
            self.metrics.request_done("error")
            if not resp.prepared:
                return msgpack_response({"error": str(exc)}, status=exc.status, headers=lease)
            await self._write_last(request, resp, encode_error_frame(str(exc), exc.status), rid)
            return resp
        except _ReaderStalled as exc:
            error = str(exc)
            self.metrics.request_done("reader_stalled")
            log.warning("request %s: %s", rid, exc)
            return resp
        finally:
            if not done:
                self.worker.abort(rid)  # client gone, stalled or error: give the blocks back now
            self.trace(request, Stage("decode.request", arrived_ns, time.time_ns(), {
                "request_id": rid, "prompt_tokens": len(prompt), "pulled_blocks": len(pinned or ()),
                "recomputed": pinned is None, "completed": done}), stages, error=error)
        self.metrics.request_done("ok")
        await self._write_last(request, resp, b"", rid)
        return resp

    async def _write_last(self, request: web.Request, resp: web.StreamResponse, data: bytes, rid: str) -> None:
        """The stream's last bytes and its end; a router that stopped reading is only logged (and cut off), and
        one that closed the stream already (it reads no further once every sample has finished) is fine."""
        try:
            await self._write(request, resp, data, eof=True)
        except _ReaderStalled as exc:
            log.warning("request %s: %s", rid, exc)
        except ConnectionResetError:
            log.debug("request %s: the router closed the stream before its end", rid)

    async def _write(self, request: web.Request, resp: web.StreamResponse, data: bytes = b"", *,
                     eof: bool = False) -> None:
        """Write ``data`` to the router (then end the answer if ``eof``), each step within
        ``write_stall_timeout_s``.

        Raises:
            _ReaderStalled: the router stopped reading; the connection is cut (aborted).
        """
        timeout_s = self.decode_config.write_stall_timeout_s
        if not await write_within(request, resp, data, eof=eof, timeout_s=timeout_s):
            raise _ReaderStalled(f"the router did not read the stream for {timeout_s:g} s "
                                 "(decode.write_stall_timeout_s); dropped and aborted")


class _ReaderStalled(Exception):
    """The router stopped reading a stream (`DecodeConfig.write_stall_timeout_s`)."""


@dataclass(frozen=True, slots=True)
class _Pulled:
    block_ids: list[int] | None  # pulled blocks (one reference each, for the engine); None: recompute
    lease_ended: bool  # the pull told the owner "done" or "abort"
    stage: Stage | None = None  # the pull's ``decode.kv_pull`` stage; None: there was nothing to pull


_TIMING_OF = {"decode.kv_pull": "kv_pull_s", "decode.queue": "decode_queue_s", "decode.first_step": "first_step_s",
              "decode.stream": "stream_s"}


def _timings(stages: list[Stage]) -> dict[str, float]:
    """The node's stage timings in seconds, by timing name (``kv_pull_s`` 0.0 when nothing was pulled)."""
    return {"kv_pull_s": 0.0, **{_TIMING_OF[s.name]: s.seconds for s in stages}}


def _pull_stage(msg: GenerationMessage, started_ns: int, *, result: PullResult | None = None,
                failure: str | None = None) -> Stage:
    """The ``decode.kv_pull`` stage from ``started_ns`` to now, with what the pull moved: ``blocks`` (the handle's),
    ``blocks_read`` (over NIXL) and ``blocks_held`` (already here), ``bytes`` read, ``tier`` (the owner's tiers the
    handle names, comma-separated), ``integrity_checked`` / ``integrity_failed`` (blocks whose digest was checked /
    did not match), and ``failure`` (a `transfer.errors` reason) for a pull that failed."""
    handle = msg.handle
    attrs: dict[str, str | int] = {
        "blocks": handle.num_blocks if handle is not None else 0,
        "tier": ",".join(sorted({tier for tier, _ in handle.blocks})) if handle is not None else ""}
    if result is not None:
        attrs.update(blocks_read=result.num_read, blocks_held=result.num_held, bytes=result.bytes_read,
                     integrity_checked=result.num_checked, integrity_failed=result.num_bad)
    if failure is not None:
        attrs["failure"] = failure
    return Stage("decode.kv_pull", started_ns, time.time_ns(), attrs)


def _engine_stages(submitted_ns: int, scheduled_ns: int, first_output_ns: int) -> list[Stage]:
    """The request's wait for its first step and that step (`engine.worker.EngineTimes` stamps)::

        submitted ── decode.queue ──▶ scheduled ── decode.first_step ──▶ first output
    """
    scheduled_ns = scheduled_ns or first_output_ns
    return [Stage("decode.queue", submitted_ns, scheduled_ns),
            Stage("decode.first_step", scheduled_ns, first_output_ns)]


def _lease_header(ended: bool) -> dict[str, str]:
    return {LEASE_HEADER: "ended" if ended else "open"}
