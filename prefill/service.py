"""The prefill service: computes a prompt's KV into paged blocks, samples the first token and hands
the decode node a leased KV handle to pull the blocks from.

    POST /prefill   msgpack {"request_id", "prompt", "params", "salt"}
                 →  msgpack {"first_token_ids", "finish_reasons", "handle", "num_cached_tokens", "prompt_logprobs"?}

Prompts are batched by the engine under its token budget (long prompts chunked across steps) and
reuse cached prefix blocks — except a prompt whose logprobs the request asks for (``params.prompt_logprobs``,
vLLM's), which is computed in full and answered with them (`engine.prompt_logprobs`). The request's full
blocks are published (keyed, KV events) and pinned under a lease the moment the engine finishes the prompt,
before any later step could evict them.

With ``prefill.serve_whole_requests`` the node also serves whole requests as a decode node serves a request
without a KV handle (`WholeRequestPrefillService`: ``POST /generate``, no KV pulls): under
``router.disaggregation: auto`` the router then places requests on it when it is the less loaded node
(`router.nodes.NodeSet.place`), so one prefill and one decode node can serve like two aggregated replicas
while still disaggregating the prompts that would stall the decode node's streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from kvrelay.decode.config import DecodeConfig
from kvrelay.decode.service import DecodeService
from kvrelay.engine.engine import LLMEngine, RequestError
from kvrelay.engine.worker import EngineFailure, EngineWorker
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.model.sampling_params import PromptTokenLogprobs, TokenLogprobs
from kvrelay.node.app import EngineNode, NodeConfig, NodeMetrics, msgpack_response
from kvrelay.node.tracing import Stage, Tracing
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.wire import PrefillReply, encode_prefill_reply

log = logging.getLogger(__name__)

# ``publish(engine, keys) -> handle``: pin the prompt's full blocks (``keys``: their block keys) under
# a lease and describe them for a reader. Runs on the engine thread
# (`prefill.kv_publish.PrefillTransfer.publish`).
PublishFn = Callable[[LLMEngine, list[BlockKey]], KvHandle | None]
# ``release(handle)``: drop a handle's lease when no decode node will read it.
ReleaseFn = Callable[[KvHandle], Awaitable[None]]


class PrefillService(EngineNode):
    def __init__(
        self,
        node: NodeConfig,
        worker: EngineWorker,
        *,
        publish: PublishFn | None = None,
        release: ReleaseFn | None = None,
        metrics: NodeMetrics | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__(node, worker, metrics=metrics, tracing=tracing)
        self._init_prefill(publish, release)

    def _init_prefill(self, publish: PublishFn | None, release: ReleaseFn | None) -> None:
        self._publish = publish
        self._release = release
        self._releases: set[asyncio.Future] = set()  # releases of handles nobody will read (fire and forget)

    def make_app(self, *, client_max_size: int = 64 * 1024 * 1024) -> web.Application:
        app = super().make_app(client_max_size=client_max_size)
        app.router.add_post("/prefill", self.prefill)
        return app

    def _release_after_engine(self, published: dict[str, KvHandle | None]) -> None:
        """Release the handle in ``published`` (if the engine publishes one) after every command queued so
        far has run on the engine thread, so a publish racing with an abort is seen."""
        if self._release is None:
            return
        release = self._release

        async def later() -> None:
            while True:  # commands run in queue order: once this one has run, so has the abort
                try:
                    await self.worker.must_run(lambda engine: None)
                    break
                except TimeoutError:  # the engine thread is busy or stuck (its watchdog ends a stuck node)
                    continue
                except Exception:  # noqa: BLE001 - the engine is gone: its pools and leases with it
                    return
            handle = published.get("handle")
            if handle is not None:
                await release(handle)

        task = asyncio.ensure_future(later())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _reason(self, engine_reason: str | None, prompt_len: int, params: Any) -> str | None:
        """Why a sample ends with its first token, or None when decode continues it. The engine ran it with
        ``max_tokens=1``: its ``stop`` (a stop token, or a grammar that ended: `LLMEngine._finish_reason`) stands;
        its ``length`` counts only if the request's own limits end it here."""
        if engine_reason == "stop":
            return "stop"
        if params.max_tokens <= 1 or prompt_len + 1 >= self.engine.max_model_len:
            return "length"
        return None

    async def prefill(self, request: web.Request) -> web.Response:
        """``POST /prefill``. Its answer carries the request's stage timings (`PrefillReply.timings`:
        ``prefill_queue_s``, ``prefill_compute_s``, ``publish_s``), and with tracing on its spans
        (``prefill.request`` → ``prefill.queue``, ``prefill.compute``, ``prefill.publish``) join the caller's trace."""
        arrived_ns = time.time_ns()
        msg = await self.read_request(request)
        if isinstance(msg, web.Response):
            return msg
        rid, prompt, params, salt = msg.request_id, msg.prompt, msg.params, msg.salt
        keys = self.block_keys_of(msg)
        published: dict[str, KvHandle | None] = {}
        publish_ns = [0, 0]  # start and end of the publish (the engine thread writes them)

        def on_finish(engine: LLMEngine, request_id: str) -> None:
            if self._publish is not None and keys:
                publish_ns[0] = time.time_ns()
                published["handle"] = self._publish(engine, keys)
                publish_ns[1] = time.time_ns()

        first: list[int | None] = [None] * params.n
        engine_reasons: list[str | None] = [None] * params.n
        first_logprobs: list[TokenLogprobs | None] = [None] * params.n
        prompt_logprobs: list[PromptTokenLogprobs] | None = None
        num_cached = 0
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        stream = self.worker.submit(rid, prompt, first_only, salt=salt, on_finish=on_finish, block_keys=keys)
        done = False
        try:
            async for out in stream:
                if out.new_token_ids:
                    first[out.index] = out.new_token_ids[0]
                if out.finished:
                    engine_reasons[out.index] = out.finish_reason
                    if out.logprobs:
                        first_logprobs[out.index] = out.logprobs[0]
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                num_cached = max(num_cached, out.num_cached_prompt_tokens)
            done = True
        except RequestError as exc:
            self.metrics.request_done("bad_request")
            self.trace(request, Stage("prefill.request", arrived_ns, time.time_ns(), {"request_id": rid}),
                       error=str(exc))
            return msgpack_response({"error": str(exc)}, status=400)
        except EngineFailure as exc:
            self.metrics.request_done("error")
            self.trace(request, Stage("prefill.request", arrived_ns, time.time_ns(), {"request_id": rid}),
                       error=str(exc))
            return msgpack_response({"error": str(exc)}, status=exc.status)
        finally:
            if not done:
                self.worker.abort(rid)
                # The client (the router) is gone or the engine failed: nobody will hear of a handle the
                # engine published, so release it once the engine thread is past the request's finish.
                self._release_after_engine(published)
        tokens = [t for t in first if t is not None]
        if len(tokens) != params.n:
            # The engine ended the prompt unstarted: it fit the pool (checked when it arrived) but the
            # pool is held by other prompts and by leases handed out. A full node, not a broken one.
            self.metrics.request_done("overloaded")
            if published.get("handle") is not None and self._release is not None:
                await self._release(published["handle"])  # nobody will read a handle this answer does not carry
            return msgpack_response({"error": "the prefill node's KV pool is full (held by running prompts and "
                                              "by KV leases); retry later"}, status=429)
        reasons = [self._reason(r, len(prompt), params) for t, r in zip(first, engine_reasons) if t is not None]
        handle = published.get("handle")
        if handle is not None and all(r is not None for r in reasons) and self._release is not None:
            await self._release(handle)  # nothing left for a decode node to read
            handle = None
        self.metrics.request_done("ok")
        log.info("request %s: prefilled %d tokens (%d from cache), first tokens %s, handle %s", rid, len(prompt),
                 num_cached, tokens, "leased" if handle is not None else "none")
        # With logprobs asked for, the engine gives every sampled token its logprobs: one per first token.
        logprobs = None if params.logprobs is None else [lp for lp in first_logprobs if lp is not None]
        stages = _prefill_stages(arrived_ns, stream.times.scheduled_ns, stream.times.finished_ns, publish_ns,
                                 num_blocks=len(keys or ()) if publish_ns[1] else 0)
        reply = PrefillReply(tokens, reasons, handle, num_cached,  # msgpack only here, at the HTTP edge
                             first_logprobs=logprobs, timings={_TIMING_OF[s.name]: s.seconds for s in stages},
                             prompt_logprobs=prompt_logprobs)
        body = encode_prefill_reply(reply)
        self.trace(request, Stage("prefill.request", arrived_ns, time.time_ns(), {
            "request_id": rid, "prompt_tokens": len(prompt), "cached_tokens": num_cached,
            "leased": handle is not None}), stages)
        return web.Response(body=body, content_type="application/msgpack")


_TIMING_OF = {"prefill.queue": "prefill_queue_s", "prefill.compute": "prefill_compute_s",
              "prefill.publish": "publish_s"}


def _prefill_stages(arrived_ns: int, scheduled_ns: int, computed_ns: int, publish_ns: list[int], *,
                    num_blocks: int) -> list[Stage]:
    """The stages of one prefilled prompt (`time.time_ns()` stamps): queue from arrival (its body read
    included) to its first step, compute to the end of the step that finished it, and the publish of its
    ``num_blocks`` full blocks (a zero-length stage when nothing was published)::

        arrived ── prefill.queue ──▶ scheduled ── prefill.compute ──▶ computed ── prefill.publish ──▶ published
    """
    scheduled_ns = scheduled_ns or computed_ns
    start, end = publish_ns if publish_ns[1] else (computed_ns, computed_ns)
    return [Stage("prefill.queue", arrived_ns, scheduled_ns),
            Stage("prefill.compute", scheduled_ns, computed_ns),
            Stage("prefill.publish", start, end, {"blocks": num_blocks})]


class WholeRequestPrefillService(PrefillService, DecodeService):
    """A prefill node that also serves whole requests: ``POST /prefill`` as `PrefillService`, and ``POST
    /generate`` as `DecodeService` for a request without a KV handle (the node prefills and decodes it; one
    with a handle is refused as a transfer failure: this node pulls no KV). Its load report says so
    (``whole_requests``), which is how the router learns it may place whole requests here."""

    def __init__(self, node: NodeConfig, config: DecodeConfig, worker: EngineWorker, *,
                 publish: PublishFn | None = None, release: ReleaseFn | None = None,
                 metrics: NodeMetrics | None = None, tracing: Tracing | None = None) -> None:
        DecodeService.__init__(self, node, config, worker, pull=None, metrics=metrics,  # EngineNode's once
                               tracing=tracing)
        self._init_prefill(publish, release)

    def load_report(self) -> dict[str, Any]:
        return {**super().load_report(), "whole_requests": True}
