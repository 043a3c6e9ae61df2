"""`RouterQueue`: requests wait in the router, in fair order, until a decode node (and a prefill node) has room.

::

    admit(reqs, tenant) ──▶ tickets        or Overloaded (429 with Retry-After), only when
        │                                    · the queue is at its bound (count or bytes) and the tenant holds
        │                                      its fair share of it, or
        │                                    · the predicted wait exceeds the deadline
        ▼
    await place(ticket) ──▶ Reservation    (`router.nodes.NodeSet.place`: the decode slot is reserved before
        │                                    the prompt is prefilled) in turn: round robin over tenants, first
        │                                    come first served within one; Overloaded once the deadline passes
        ▼
    reservation.prefilled / pulled, then finish(ticket, reservation, generated)   (the dispatcher)

Every change that may free room (a finished or prefilled request, a node's load report, a node coming
back) calls `pump`, which places queued tickets while the next one in turn fits; the head waits rather
than being overtaken, so a large request is never starved by small ones.

Predicted wait of a request queued now, in seconds, from the rates the nodes measure and report
(`router.nodes.NodeCapacity`), over the work queued ahead of it:

    prefill part = queued uncached prompt tokens / Σ prefill_tokens_per_s (prefill nodes; else decode nodes)
    decode part  = queued expected output tokens / Σ (slots / decode_step_s) over decode nodes
    wait         = max(parts) with prefill nodes (they compute beside the decode nodes), else their sum

``slots`` is what a decode node runs at once (``max_num_seqs``, or fewer when its KV blocks hold fewer of
the queued requests); expected output is ``max_tokens`` × the decayed share of ``max_tokens`` finished
requests generated. A rate not measured yet counts as no wait: nothing is refused on a guess.

Fair share. With the queue full, a newcomer whose tenant (API key) holds fewer than its share
(bound / tenants queued, itself included) pushes out the newest request of the tenant holding the most,
which gets the 429 instead; otherwise the newcomer gets it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.kvstore.block_key import BlockKey
from kvrelay.router.nodes import Need, NodeSet, Reservation
from kvrelay.router.openai_api import ApiError, GenerationRequest

OUTPUT_SHARE_DECAY = 0.05  # weight of each finished request in the expected share of max_tokens
MAX_RETRY_AFTER_S = 60
# A generation request's stages as the router sees them: waiting in this queue for room; its prompt on a
# prefill node (or, with none, on the decode node before its first frame); its KV handle with a decode node
# before the first decode frame (the pull, and the wait for a first step there); streaming from a decode node.
RUN_STAGES = ("queued", "prefill", "pull", "decode")
BYTES_PER_PROMPT_TOKEN = 4  # what a queued prompt costs, held as array('I') (`compact`)
BYTES_PER_BLOCK_KEY = 73  # a queued request's block key: a 32-byte `bytes` (65 B in CPython) and its list slot


class Overloaded(ApiError):
    """A request the router will not queue (or that waited past its deadline): 429 with ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int, reason: str) -> None:
        super().__init__(429, message, retry_after_s=retry_after_s)
        self.reason = reason  # queue_full | fair_share | predicted_wait | deadline


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """``max_requests``/``max_bytes``: the queue's bounds (prompts as held: 4 bytes a token, 73 a block key);
    ``timeout_s``: how long a request may wait for room (its deadline; `router.deadline`: the generation deadline
    starts after it); ``decode_reserve_tokens``: output tokens a decode node's room is reserved for, at most
    (beyond them the node preempts, as vLLM does)."""

    max_requests: int = 8192
    max_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 300.0
    decode_reserve_tokens: int = 256


@dataclass(eq=False)
class Ticket:
    """One generation request's place in the queue."""

    need: Need
    keys: Sequence[BlockKey]
    tenant: bytes
    uncached_tokens: int  # prompt tokens no prefill node holds (as the router's KV index knew at admission)
    max_output_tokens: int  # max_tokens × n
    num_bytes: int
    deadline: float  # monotonic seconds
    enqueued_at: float
    taken: bool = False  # its run began (`router.dispatch.Dispatcher.run`): from then on the run gives it back
    # Where its run is (one of RUN_STAGES; only `Dispatcher.run` writes it after admission): what a client that
    # leaves now aborts, for `kvrelay_router_aborts_total{stage}`. "done" once its last sample ended.
    stage: str = "queued"
    placed: asyncio.Future[Reservation] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(frozen=True, slots=True)
class QueueMetrics:
    """Callbacks the router's Prometheus metrics provide: ``queued(n)``, ``waited(seconds)``, ``refused(reason)``."""

    queued: Callable[[int], None] = lambda n: None
    waited: Callable[[float], None] = lambda s: None
    refused: Callable[[str], None] = lambda reason: None


def compact(req: GenerationRequest) -> GenerationRequest:
    """``req`` with its prompt held as it is counted while queued: 4 bytes a token (``array('I')``, where a list
    holds an 8-byte pointer a token and a 28-byte int for each id above 256: 36 B). `Dispatcher.run` makes it a
    list again once placed. Token ids are below 2**32 (`kvstore.block_key`)."""
    return dataclasses.replace(req, prompt_token_ids=array("I", req.prompt_token_ids))  # type: ignore[arg-type]


def need_of(req: GenerationRequest, *, block_size_tokens: int, decode_reserve_tokens: int) -> Need:
    """The room ``req`` holds: full prompt blocks shared by its samples, and per sample a tail for the first
    token (prefill node) or for the output it keeps (decode node, at most ``decode_reserve_tokens``), which is also
    the output it is expected to decode. A request that asks for its prompt's logprobs needs a prefill node (the
    node whose answer carries them: `router.dispatch.Dispatcher.run`)."""
    b, p, n = block_size_tokens, len(req.prompt_token_ids), req.params.n
    kept = min(req.params.max_tokens, decode_reserve_tokens)
    full, rest = divmod(p, b)
    return Need(prompt_tokens=p, prefill_blocks=full + n * -(-(rest + 1) // b),
                decode_blocks=full + n * -(-(rest + kept) // b), seqs=n, decode_tokens=kept,
                needs_prefill_node=req.params.prompt_logprobs is not None)


class RouterQueue:
    """Owned by the router's event loop."""

    def __init__(self, nodes: NodeSet, config: QueueConfig, *, metrics: QueueMetrics | None = None) -> None:
        self.nodes = nodes
        self.config = config
        self.metrics = metrics or QueueMetrics()
        self._tenant_to_tickets: OrderedDict[bytes, deque[Ticket]] = OrderedDict()  # next in turn first
        self.num_queued = 0
        self.num_bytes = 0
        self.queued_uncached_tokens = 0
        self.queued_output_tokens = 0  # max_tokens × n, summed
        self.queued_decode_blocks = 0
        self.output_share = 1.0  # decayed share of max_tokens that finished requests generated

    # ------------------------------------------------------------ admission
    def admit(self, reqs: Sequence[GenerationRequest], keys: Sequence[Sequence[BlockKey]],
              tenant: bytes) -> list[Ticket]:
        """Queue the generation requests of one API request (``keys[i]``: the block keys of ``reqs[i]``).

        Raises:
            Overloaded: see the module docstring; nothing of the request is queued then.
        """
        now = time.monotonic()
        tickets = [self._ticket(r, k, tenant, now) for r, k in zip(reqs, keys, strict=True)]
        wait_s = self.predicted_wait_s()
        if wait_s > self.config.timeout_s:
            self._refuse("predicted_wait")
            raise Overloaded(f"the router's queue is predicted to take {wait_s:.0f} s, beyond the "
                             f"{self.config.timeout_s:g} s a request may wait (router.queue_timeout_s); retry later",
                             retry_after_s=_clamp(wait_s - self.config.timeout_s), reason="predicted_wait")
        count, size = len(tickets), sum(t.num_bytes for t in tickets)
        if count > self.config.max_requests or size > self.config.max_bytes:
            self._refuse("queue_full")
            raise Overloaded(f"the request ({count} prompts, {size} prompt bytes) is larger than the router's whole "
                             "queue (router.max_queued_requests, router.max_queued_bytes)", retry_after_s=
                             MAX_RETRY_AFTER_S, reason="queue_full")
        while self.num_queued + count > self.config.max_requests or self.num_bytes + size > self.config.max_bytes:
            self._make_room(tenant, count)
        for t in tickets:
            self._push(t)
        self.pump()
        return tickets

    def _ticket(self, req: GenerationRequest, keys: Sequence[BlockKey], tenant: bytes, now: float) -> Ticket:
        need = need_of(req, block_size_tokens=self.nodes.block_size_tokens,
                       decode_reserve_tokens=self.config.decode_reserve_tokens)
        held = self.nodes.index.prefix_blocks(keys, [n.name for n in self.nodes.prefill or self.nodes.decode])
        cached = max(held.values(), default=0) * self.nodes.block_size_tokens
        return Ticket(need, keys, tenant, max(0, need.prompt_tokens - cached), req.params.max_tokens * req.params.n,
                      need.prompt_tokens * BYTES_PER_PROMPT_TOKEN + len(keys) * BYTES_PER_BLOCK_KEY,
                      now + self.config.timeout_s, now)

    def _make_room(self, tenant: bytes, count: int) -> None:
        """Push out the newest ticket of the tenant holding the most, if ``tenant`` is under its share.
        Raises Overloaded (for the newcomer) otherwise."""
        tenants = set(self._tenant_to_tickets) | {tenant}
        share = self.config.max_requests // len(tenants)
        mine = len(self._tenant_to_tickets.get(tenant, ()))
        biggest = max(self._tenant_to_tickets, key=lambda t: len(self._tenant_to_tickets[t]), default=None)
        if biggest is None or biggest == tenant or mine + count > share:
            self._refuse("queue_full")
            raise Overloaded(f"the router's queue is full ({self.num_queued} requests, router.max_queued_requests "
                             f"{self.config.max_requests}, router.max_queued_bytes {self.config.max_bytes}); "
                             "retry later", retry_after_s=_clamp(self.predicted_wait_s()), reason="queue_full")
        victim = self._tenant_to_tickets[biggest][-1]
        self._remove(victim)
        self._refuse("fair_share")
        victim.placed.set_exception(Overloaded(
            "the router's queue is full and this API key holds more than its share of it; retry later",
            retry_after_s=_clamp(self.predicted_wait_s()), reason="fair_share"))

    def _refuse(self, reason: str) -> None:
        self.metrics.refused(reason)

    # ------------------------------------------------------------ placement
    async def place(self, ticket: Ticket) -> Reservation:
        """Wait for ``ticket``'s turn and room; the reservation is the caller's to `finish`.

        Raises:
            Overloaded: the deadline passed first, or a newcomer with a fairer claim pushed it out.
        """
        if not ticket.placed.done():
            remaining = ticket.deadline - time.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(ticket.placed), max(0.0, remaining))
            except asyncio.TimeoutError:
                if not ticket.placed.done():
                    self._remove(ticket)
                    self._refuse("deadline")
                    raise Overloaded(f"no node had room for the request within {self.config.timeout_s:g} s "
                                     "(router.queue_timeout_s); retry later", retry_after_s=_clamp(
                                         self.predicted_wait_s()), reason="deadline") from None
            except asyncio.CancelledError:
                self.abandon(ticket)
                raise
        return ticket.placed.result()

    def abandon(self, ticket: Ticket) -> None:
        """The request went away: out of the queue, or its room given back if it was placed."""
        if not ticket.placed.done():
            self._remove(ticket)
            ticket.placed.cancel()
        elif not ticket.placed.cancelled() and ticket.placed.exception() is None:
            ticket.placed.result().release()
            self.pump()

    def finish(self, ticket: Ticket, reservation: Reservation, generated_tokens: int) -> None:
        """The request ended after generating ``generated_tokens`` (all samples): its room goes back."""
        reservation.release()
        if ticket.max_output_tokens > 0:
            share = min(1.0, generated_tokens / ticket.max_output_tokens)
            self.output_share += OUTPUT_SHARE_DECAY * (share - self.output_share)
        self.pump()

    def pump(self) -> None:
        """Place queued tickets, in turn, while the next one fits somewhere."""
        while self._tenant_to_tickets:
            tenant, tickets = next(iter(self._tenant_to_tickets.items()))
            ticket = tickets[0]
            reservation = self.nodes.place(ticket.need, ticket.keys)
            if reservation is None:
                return
            self._remove(ticket)
            self._tenant_to_tickets.pop(tenant, None)
            if tickets:
                self._tenant_to_tickets[tenant] = tickets  # to the back of the turn
            self.metrics.waited(time.monotonic() - ticket.enqueued_at)
            ticket.placed.set_result(reservation)

    # ------------------------------------------------------------ prediction
    def predicted_wait_s(self) -> float:
        """Seconds a request queued now would wait (module docstring)."""
        nodes = self.nodes
        now = time.monotonic()
        decode = [n.capacity for n in nodes.decode if n.healthy(now) and n.capacity is not None]
        prefill_nodes = [n.capacity for n in nodes.prefill if n.healthy(now) and n.capacity is not None]
        prefill_rate = sum(c.prefill_tokens_per_s for c in (prefill_nodes or decode))
        mean_blocks = max(1.0, self._mean_decode_blocks())
        decode_rate = sum(min(float(c.max_num_seqs), max(1.0, c.kv_blocks / mean_blocks)) / c.decode_step_s
                          for c in decode if c.decode_step_s > 0)
        prefill_s = self.queued_uncached_tokens / prefill_rate if prefill_rate > 0 else 0.0
        decode_s = self.queued_output_tokens * self.output_share / decode_rate if decode_rate > 0 else 0.0
        return max(prefill_s, decode_s) if prefill_nodes else prefill_s + decode_s

    def _mean_decode_blocks(self) -> float:
        return self.queued_decode_blocks / self.num_queued if self.num_queued else 1.0

    # ------------------------------------------------------------ bookkeeping
    def _push(self, ticket: Ticket) -> None:
        self._tenant_to_tickets.setdefault(ticket.tenant, deque()).append(ticket)
        self._count(ticket, +1)

    def _remove(self, ticket: Ticket) -> None:
        tickets = self._tenant_to_tickets.get(ticket.tenant)
        if tickets is None or ticket not in tickets:
            return
        tickets.remove(ticket)
        if not tickets:
            del self._tenant_to_tickets[ticket.tenant]
        self._count(ticket, -1)

    def _count(self, ticket: Ticket, sign: int) -> None:
        self.num_queued += sign
        self.num_bytes += sign * ticket.num_bytes
        self.queued_uncached_tokens += sign * ticket.uncached_tokens
        self.queued_output_tokens += sign * ticket.max_output_tokens
        self.queued_decode_blocks += sign * ticket.need.decode_blocks
        self.metrics.queued(self.num_queued)


def _clamp(seconds: float) -> int:
    """A Retry-After value: whole seconds in [1, MAX_RETRY_AFTER_S]."""
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))
