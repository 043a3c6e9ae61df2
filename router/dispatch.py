"""`Dispatcher`: one request's path through the cluster.

    queue (`router.queue`: wait for room)          ─▶ a reserved decode node (and prefill node)
    prefill node (longest cached prefix vs. queue) ─▶ first token(s) + KV handle
    decode node (load vs. own prefix)              ─▶ pulls the KV, streams the rest

No prefill node (aggregated deployment, or all prefill nodes down): the decode node prefills the
request itself. The reserved nodes are tried first.

Node failures and request failures. A node is taken out only when it is down: it could not be connected
to (the request was never sent: the next node is tried), it answered 503 (going away: likewise), or a
request's answer broke and the node then does not answer ``/ready`` (`Dispatcher._node_died`). A 5xx other
than 503, or an answer broken off by a node that is up (e.g. the decode node's cut of a stream the router
stopped reading), is that request's own error: it goes to its client, the node stays in and nothing
moves. A prefill node that died under a request is not followed by another (the request may be what
killed it: 503). A decode node that died under a request moves it, once: a request under which a second
node dies ends with 503 (``NODE_DEATHS_SURVIVED``). A decode node that is down before its first frame is
replaced by the next one; one that is down mid-stream is replaced, and the request moves (at most
``migration_limit`` times) to another decode node, which continues
every unfinished sample from the tokens already sent (`GenerationMessage.resume_token_ids`): the client
sees one stream, no token repeated or lost, and a greedy or seeded sample continues with the tokens an
undisturbed run gives (sampling is keyed by seed, sample and output position: `model.sampling`). The
prompt's KV comes from the request's handle while its lease is open, else from a fresh prefill (the
prefill node's cache holds the prompt, usually), else the decode node recomputes it. A
node that answers 429 (full: another router's requests, or a node restarted smaller) is not taken out:
the next one is tried; when every decode node is full the request waits up to `DECODE_FULL_WAIT_S` for
a slot, then gets 429.

Leases. A KV handle's lease ends on the prefill node when the decode node that took it says so
(`transfer.config.LEASE_HEADER` on its answer: it sent "done" or "abort"); in every other case —
refused, failed before its answer, no decode node left, the client gone — the router releases it at
once, not at the lease's TTL. Releasing a lease a reader may still be using is safe: the reader checks
that its lease covered its READ (`transfer.lease_keeper`) and recomputes otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from kvrelay.kvstore.block_key import block_keys
from kvrelay.model.sampling_params import PromptTokenLogprobs, TokenLogprobs
from kvrelay.model.structured import GRAMMAR_ERROR_PREFIX
from kvrelay.router.backends import (
    Backends,
    NodeBroke,
    NodeLeaving,
    NodeRefused,
    NodeUnavailable,
    NodeUnreachable,
)
from kvrelay.router.cache_salt import request_salt
from kvrelay.router.node_state import Node
from kvrelay.router.nodes import NodeSet, Reservation
from kvrelay.router.openai_api import ApiError, GenerationRequest
from kvrelay.router.plan import PlanChoice
from kvrelay.router.queue import QueueConfig, QueueMetrics, RouterQueue, Ticket
from kvrelay.router.request_trace import RunTrace
from kvrelay.transfer.config import LEASE_HEADER
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.wire import (
    GenerationMessage,
    PrefillReply,
    StreamError,
    WireError,
    decode_frame,
    decode_prefill_reply,
    encode_generation,
)

log = logging.getLogger(__name__)
DECODE_FULL_WAIT_S = 5.0  # how long a prefilled request waits for a decode slot before its 429
# A request survives one decode node dying under it (it moves on); the second may well be its own doing.
NODE_DEATHS_SURVIVED = 1
PROBE_TIMEOUT_S = 5.0  # a node asked whether it is up after a request's answer broke: its /ready within this


@dataclass(frozen=True, slots=True)
class SampleDelta:
    index: int
    token_ids: list[int]
    finished: bool
    reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    # prompt tokens served from a prefix cache (the prefill node's; under a local plan the decode node's): on
    # one delta of each run, the first that knows it; None on the others
    num_cached_tokens: int | None = None
    # the prompt's logprobs (positions 1 to P - 1), on sample 0's first delta, when the request asked
    prompt_logprobs: list[PromptTokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """Learned from a node's ``/info`` at start."""

    block_size_tokens: int
    spec_fingerprint: bytes
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


class Dispatcher:
    """Admits requests to the queue (`admit`) and runs them (`run`). Owned by the router's event loop."""

    def __init__(self, nodes: NodeSet, backends: Backends, info: ClusterInfo, *, queue: QueueConfig | None = None,
                 queue_metrics: QueueMetrics | None = None, migration_limit: int = 3,
                 migrated: Callable[[str], None] = lambda outcome: None,
                 planned: Callable[[PlanChoice, float], None] = lambda choice, ttft_s: None) -> None:
        """``migration_limit``: times one request may move to another decode node mid-stream (0: never);
        ``migrated(outcome)`` hears each move ("moved") and each request that could not move ("limit",
        "no_node"); ``planned(choice, ttft_s)`` hears each request's plan (`router.plan`) and its actual
        time from placement to its first token (seconds), once that token has come."""
        self.nodes = nodes
        self.backends = backends
        self.info = info
        self.migration_limit = migration_limit
        self._migrated = migrated
        self._planned = planned
        self.queue = RouterQueue(nodes, queue or QueueConfig(), metrics=queue_metrics or QueueMetrics())
        self._releases: set[asyncio.Future] = set()  # lease releases in flight (fire and forget)

    def keys_for(self, prompt: list[int], salt: bytes) -> list[bytes]:
        return block_keys(prompt, block_size_tokens=self.info.block_size_tokens,
                          spec_fingerprint=self.info.spec_fingerprint, salt=salt)

    def admit(self, reqs: list[GenerationRequest], salt: bytes) -> list[Ticket]:
        """Queue the generation requests of one API request (``salt``: its tenant).

        Raises:
            Overloaded: the queue will not take them (429 with Retry-After).
        """
        return self.queue.admit(reqs, [self.keys_for(r.prompt_token_ids, request_salt(salt, r.cache_salt))
                                       for r in reqs], salt)

    async def _prefill(self, req: GenerationRequest, salt: bytes, keys: Sequence[bytes],
                       reserved: Node | None, trace: RunTrace) -> tuple[PrefillReply, Node] | None:
        """First tokens and KV handle from ``reserved`` (then any other prefill node up), and that node;
        None when none is: ``reserved`` None (no prefill node was up at placement), or all failed.
        ``trace`` hears the node's stage timings and names the parent span of the call.

        Raises:
            ApiError: the request was refused (4xx), or every prefill node is full (429).
        """
        if reserved is None:
            return None
        tried: set[str] = set()
        full: NodeRefused | None = None
        body = encode_generation(GenerationMessage(req.request_id, req.prompt_token_ids, req.params, salt))
        node: Node | None = reserved
        while True:
            if node is None:
                node = self.nodes.pick_prefill(keys, len(req.prompt_token_ids), exclude=tried)
            if node is None:
                if full is not None:  # up but full: not a reason to move the prompt onto a decode node
                    raise ApiError(429, full.message)
                return None
            tried.add(node.name)
            node.in_flight += 1
            try:
                try:
                    answer = decode_prefill_reply(await self.backends.post(node, "/prefill", body,
                                                                           headers=trace.prefill_headers()))
                except WireError as exc:
                    raise NodeUnavailable(f"{node.name}: malformed /prefill answer: {exc}") from None
                if len(answer.first_token_ids) != req.params.n:
                    raise NodeUnavailable(f"{node.name}: {len(answer.first_token_ids)} first tokens for "
                                          f"n={req.params.n}")
                got, wanted = answer.prompt_logprobs, len(req.prompt_token_ids) - 1
                if req.params.prompt_logprobs is not None and (got is None or len(got) != wanted):
                    raise NodeUnavailable(f"{node.name}: no prompt_logprobs for each of the {wanted} prompt "
                                          "positions after the first")
                if answer.handle_error is not None:
                    log.warning("request %s: %s sent a malformed KV handle (%s); decode will recompute",
                                req.request_id, node.name, answer.handle_error)
                trace.node_timings(answer.timings)
                log.info("request %s: prefilled on %s (%d prompt tokens, %d from cache)", req.request_id, node.name,
                         len(req.prompt_token_ids), answer.num_cached_tokens)
                return answer, node
            except NodeUnavailable as exc:
                if isinstance(exc, NodeBroke) and not await self._node_died(node, exc):
                    raise ApiError(502, f"{node.name} broke off this request's prefill ({exc}) and is up; the "
                                        "request is not sent to another node") from None
                self.nodes.mark_down(node, str(exc))
                if isinstance(exc, NodeBroke):  # it died under this request, which may be what killed it
                    raise ApiError(503, f"{node.name} died while prefilling this request ({exc}); it is not sent "
                                        "to another node (it may be what killed this one); retry later") from None
                log.warning("request %s: %s; trying another prefill node", req.request_id, exc)
            except NodeRefused as exc:
                if exc.status != 429:
                    raise ApiError(exc.status, exc.message, param=_param_of(req, exc)) from None
                full = exc  # this node is at capacity: another may not be
            finally:
                node.in_flight -= 1
            node = None

    async def run(self, req: GenerationRequest, salt: bytes, ticket: Ticket, *,
                  trace: RunTrace | None = None) -> AsyncIterator[SampleDelta]:
        """Wait for ``ticket``'s turn (`admit` gave it), then yield token deltas per sample until every
        sample has finished. ``trace`` (default: a fresh untraced one) hears each stage as it passes
        (`router.request_trace`).

        ``salt`` is the tenant's; the request's KV is keyed under it and the request's ``cache_salt``
        (`router.cache_salt`).

        Raises:
            Overloaded: the request waited past its deadline, or was pushed out of the queue.
            ApiError: 4xx for a refused request, 429 when full, 503 when no node can serve.
        """
        salt = request_salt(salt, req.cache_salt)
        ticket.taken = True
        trace = trace or RunTrace.untraced(req.request_id)
        reservation = await self.queue.place(ticket)
        ticket.stage = "prefill"
        if not isinstance(req.prompt_token_ids, list):  # held compactly while queued (`router.queue.compact`)
            req = dataclasses.replace(req, prompt_token_ids=list(req.prompt_token_ids))
        placed_at = time.monotonic()
        trace.placed(reservation.choice, prefill=None if reservation.prefill is None else reservation.prefill.name,
                     decode=reservation.decode.name)
        error: str | None = None  # why the run failed, for its trace
        n = req.params.n
        finished = [False] * n
        generated = 0  # tokens yielded, all samples
        handle: KvHandle | None = None
        lease = _Lease()  # lease.lease_id (on lease.owner): what the router releases unless a decode node ended it
        cached_known = False  # a delta has carried the run's num_cached_tokens
        try:
            prefilled = await self._prefill(req, salt, ticket.keys, reservation.prefill, trace)
            if reservation.prefill is not None:
                reservation.prefilled()
            first = None
            if prefilled is None and req.params.prompt_logprobs is not None:
                raise ApiError(503, "prompt_logprobs are computed by a prefill node, and none is up; retry later",
                               param="prompt_logprobs")
            if prefilled is not None:
                self._first_token(req, reservation, placed_at, trace)
                pre, lease.owner = prefilled
                first = pre.first_token_ids
                # The owner's URL as this router reached it (configured, so decode nodes accept it), not
                # the name the prefill node gave itself (another name for the same node, e.g. its FQDN).
                handle = None if pre.handle is None else dataclasses.replace(pre.handle, owner_url=lease.owner.url)
                # a malformed handle's too (by its readable lease id): nobody can pull it
                lease.lease_id = handle.lease_id if handle is not None else pre.lease_id
                if handle is None:
                    reservation.pulled()  # nothing leased: the prefill node holds nothing for this request
                ticket.stage = "pull" if handle is not None else "prefill"  # without a handle decode computes it
                self._paced(req, reservation, 1)
                for i, (tok, reason) in enumerate(zip(first or [], pre.finish_reasons, strict=True)):
                    finished[i] = reason is not None
                    generated += 1
                    if all(finished):
                        ticket.stage = "done"
                    yield SampleDelta(i, [tok], finished[i], reason,
                                      None if pre.first_logprobs is None else [pre.first_logprobs[i]],
                                      pre.num_cached_tokens if i == 0 else None,
                                      pre.prompt_logprobs if i == 0 else None)
                cached_known = True
                if all(finished):
                    return  # the prefill node released the lease itself
            async for delta in self._decode(req, salt, ticket.keys, first, handle, finished,
                                            _Started(reservation, lease), reservation.decode, trace):
                if delta.num_cached_tokens is not None:
                    if cached_known:  # the prefill node's count (or a node's before a move) stands
                        delta = dataclasses.replace(delta, num_cached_tokens=None)
                    cached_known = True
                if not generated:
                    self._first_token(req, reservation, placed_at, trace)
                if delta.index == 0:
                    self._paced(req, reservation, len(delta.token_ids))
                generated += len(delta.token_ids)
                ticket.stage = "done" if all(finished) else "decode"  # the consumer may stop at the last
                yield delta
            ticket.stage = "done"
        except ApiError as exc:
            error = exc.message
            raise
        except Exception as exc:
            error = repr(exc)
            raise
        finally:
            trace.end(error)
            reservation.decode.stream_ended(id(reservation))
            self.queue.finish(ticket, reservation, generated)
            self._release(lease)

    def _paced(self, req: GenerationRequest, reservation: Reservation, tokens: int) -> None:
        """``tokens`` more of ``req``'s first sample went out: its decode node's stream pace hears of them
        (`router.node_state.Node.observe_tokens`; what a local prefill's TPOT cost is priced from)."""
        expected = min(req.params.max_tokens, self.queue.config.decode_reserve_tokens)
        reservation.decode.observe_tokens(id(reservation), tokens=tokens, now=time.monotonic(), expected=expected)

    def _first_token(self, req: GenerationRequest, reservation: Reservation, placed_at: float,
                     trace: RunTrace) -> None:
        """The request's first token came: its prompt left its node's queue; the plan and ``trace`` hear how long
        it took."""
        trace.first_token()
        reservation.prefilled()
        choice = reservation.choice
        if choice is not None:
            ttft_s = time.monotonic() - placed_at
            log.info("request %s: plan %s on %s, TTFT predicted %.3f s (model %.3f s), actual %.3f s; costs %s",
                     req.request_id, choice.plan, (reservation.prefill or reservation.decode).name,
                     choice.predicted_ttft_s, choice.model_ttft_s, ttft_s,
                     {k: round(v, 3) for k, v in choice.costs.items()})
            self._planned(choice, ttft_s)
            self.nodes.calibration.observe(choice.plan, choice.model_ttft_s, ttft_s)

    def _release(self, lease: _Lease) -> None:
        """Release ``lease`` on its owner (fire and forget) unless a decode node ended it."""
        if lease.lease_id is not None and lease.owner is not None and not lease.ended:
            task = asyncio.ensure_future(self.backends.release_lease(lease.owner, lease.lease_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
        lease.lease_id = None

    async def _node_died(self, node: Node, exc: NodeBroke) -> bool:
        """Whether ``node``, whose answer to a request broke (``exc``), is down: the health poll found it
        unreachable, or it does not answer ``/ready`` with 200 now (refused connect, an error, 503 while it
        drains or its engine is given up). A node that answers, even slowly, is up: it ended that request
        alone, which is then that request's error (no move, the node stays in)."""
        if exc.lost:
            return True
        up = await self.backends.is_up(node, timeout_s=PROBE_TIMEOUT_S)
        log.warning("%s: %s; it is %s", node.name, exc, "up" if up else "down")
        return not up

    async def _resume_handle(self, req: GenerationRequest, salt: bytes, keys: Sequence[bytes],
                             handle: KvHandle | None, lease: _Lease, trace: RunTrace) -> KvHandle | None:
        """The prompt's KV for a request moving to another decode node: ``handle`` while its lease is open
        (no decode node ended it), else a fresh handle from a prefill node (whose cache holds the prompt,
        usually; its first tokens are not used), else None (the decode node recomputes)."""
        if handle is not None and not lease.ended:
            return handle
        node = self.nodes.pick_prefill(keys, len(req.prompt_token_ids))
        try:
            prefilled = await self._prefill(req, salt, keys, node, trace)
        except ApiError as exc:
            log.warning("request %s: no fresh KV handle to resume with (%s); the decode node recomputes",
                        req.request_id, exc.message)
            return None
        if prefilled is None:
            return None
        pre, owner = prefilled
        self._release(lease)
        lease.owner, lease.ended = owner, False
        lease.lease_id = pre.handle.lease_id if pre.handle is not None else pre.lease_id
        return None if pre.handle is None else dataclasses.replace(pre.handle, owner_url=owner.url)

    async def _decode(self, req: GenerationRequest, salt: bytes, keys: Sequence[bytes], first: list[int] | None,
                      handle: KvHandle | None, finished: list[bool], started: _Started,
                      reserved: Node, trace: RunTrace) -> AsyncIterator[SampleDelta]:
        """The decode phase of `run`, on ``reserved`` first; ``started`` hears each answer's headers, ``trace``
        the nodes' stage timings."""
        n = req.params.n
        sent: list[list[int]] = [[t] for t in first] if first is not None else [[] for _ in range(n)]
        migrations = 0
        deaths = 0  # decode nodes that died (or went away) while this request was sent to them
        failure = ""  # why the last decode node that began failed
        tried: set[str] = set()
        full: NodeRefused | None = None
        wait_until = time.monotonic() + DECODE_FULL_WAIT_S
        pause = 0.02
        body = encode_generation(GenerationMessage(  # the same for every node tried, until a move
            req.request_id, req.prompt_token_ids, req.params, salt, first_token_ids=first, handle=handle,
            long_context=req.long_context))
        node: Node | None = reserved
        while True:
            if node is None:
                node = self.nodes.pick_decode(keys, exclude=tried)
            if node is None and full is not None and time.monotonic() < wait_until:
                # Every decode node is full. The prompt is prefilled (its first token may already be
                # with the client): wait a little for a slot rather than waste it.
                await asyncio.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, 0.5)
                tried.clear()
                full = None
                continue
            if node is None:
                if full is not None:
                    raise ApiError(429, full.message)
                if migrations:
                    self._migrated("no_node")
                    raise ApiError(503, f"{failure}; no other decode node is available to continue it, retry later")
                raise ApiError(503, "no decode node is available; retry later")
            tried.add(node.name)
            began = False
            node.in_flight += 1
            log.info("request %s: decoding on %s (KV handle: %s%s)", req.request_id, node.name, handle is not None,
                     f", move {migrations}" if migrations else "")
            try:
                async for obj in self.backends.stream(node, "/generate", body, on_headers=started.headers,
                                                      headers=trace.decode_headers()):
                    try:
                        frame = decode_frame(obj)
                    except StreamError as exc:
                        if exc.status == 503:  # the node is going away (draining, engine given up)
                            raise NodeLeaving(exc.message) from None
                        raise ApiError(exc.status, exc.message) from None  # this request failed there
                    except WireError as exc:
                        raise NodeUnavailable(f"{node.name}: malformed frame: {exc}") from None
                    if frame.index >= n:
                        raise NodeUnavailable(f"{node.name}: a frame for sample {frame.index} of {n}")
                    began = True
                    trace.node_timings(frame.timings)
                    i = frame.index
                    if finished[i]:
                        continue
                    finished[i] = frame.finished
                    sent[i].extend(frame.tokens)
                    yield SampleDelta(i, frame.tokens, finished[i], frame.reason, frame.logprobs,
                                      frame.num_cached_tokens)
                if not all(finished):
                    raise NodeBroke(f"{node.name} ended the stream before every sample finished")
                return
            except NodeUnavailable as exc:
                if isinstance(exc, NodeBroke) and not await self._node_died(node, exc):
                    # e.g. it cut off this stream because the router stopped reading it (its client did)
                    raise ApiError(502, f"{node.name} broke off this request's stream ({exc}) and is up; the "
                                        "request is not moved to another node") from None
                self.nodes.mark_down(node, str(exc))
                if not isinstance(exc, NodeUnreachable):  # sent: the node failed under this request
                    deaths += 1
                if deaths > NODE_DEATHS_SURVIVED:
                    self._migrated("repeat_death")
                    raise ApiError(503, f"a second node failed under this request ({exc}); it is not sent to "
                                        "another (it may be what kills them)") from None
                if not began:
                    log.warning("request %s: %s; trying another decode node", req.request_id, exc)
                elif migrations >= self.migration_limit:
                    self._migrated("limit")
                    raise ApiError(503, f"the decode node failed mid-request ({migrations} of "
                                        f"router.migration_limit={self.migration_limit} moves made): {exc}") from None
                else:
                    migrations += 1
                    failure = str(exc)
                    self._migrated("moved")
                    log.warning("request %s: %s; moving it to another decode node (move %d of %d, %d tokens sent)",
                                req.request_id, exc, migrations, self.migration_limit, sum(map(len, sent)))
                    handle = await self._resume_handle(req, salt, keys, handle, started.lease, trace)
                    body = encode_generation(GenerationMessage(
                        req.request_id, req.prompt_token_ids, req.params, salt, handle=handle,
                        long_context=req.long_context,
                        resume_token_ids=[None if done else list(toks) for toks, done in zip(sent, finished)]))
            except NodeRefused as exc:
                if exc.status != 429:
                    raise ApiError(exc.status, exc.message, param=_param_of(req, exc)) from None
                full = exc  # at capacity (refused before reading anything): try another decode node
            finally:
                node.in_flight -= 1
            node = None


def _param_of(req: GenerationRequest, exc: NodeRefused) -> str | None:
    """The request field a node's 4xx is about, when the router can tell: a constraint the node could not
    compile names the field it came from."""
    return req.structured_param if exc.message.startswith(GRAMMAR_ERROR_PREFIX) else None


@dataclass(slots=True)
class _Lease:
    lease_id: str | None = None  # the prefill node's lease for this request, if it granted one
    owner: Node | None = None  # the prefill node that holds it
    ended: bool = False  # a decode node said it ended the handle's lease (LEASE_HEADER)


@dataclass(frozen=True, slots=True)
class _Started:
    """Hears the headers of each decode node's answer: its KV is pulled (the prefill node's room is free)
    once one answers, and the lease is over if it says so."""

    reservation: Reservation
    lease: _Lease

    def headers(self, headers: Mapping[str, str]) -> None:
        if headers.get(LEASE_HEADER) == "ended":
            self.lease.ended = True
        self.reservation.pulled()
