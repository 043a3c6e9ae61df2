"""`NodeSet`: the router's view of its prefill and decode nodes, and the routing decision.

Prefill: the node that holds the longest prefix of the request's block keys, weighed against the
tokens it still has to compute for requests the router sent it:

    cost(node) = (prompt_tokens - cached_prefix_tokens(node)) + queued_prompt_tokens(node)

Decode: the node with the fewest requests placed or in flight there, each weighed as
``load_weight_tokens``, minus the prompt tokens it already holds (its own prefix cache saves a pull):

    cost(node) = max(in_flight, reserved_seqs)(node) · load_weight_tokens - cached_prefix_tokens(node)

Once every decode node with room has reported its rates (and the mode is not ``always``), the one where
prefilling and decoding the request breaches the fewest SLOs, then costs least, instead (`NodeSet._priced_decode`,
`router.plan.whole_plan`): the time to its first token there, the stall on that node's streams and its decode
(its own steps, and its row in the steps of the streams beside it).

Capacity. Each node reports its size and rates in its event answers (`NodeCapacity`); the router keeps
its own ledger of what it has placed there (`Node.reserved_blocks`, ``reserved_seqs``, ``queued_tokens``),
and `NodeSet.place` reserves a decode node and a prefill node for a request only where both have room:

    decode:  reserved_blocks + need.decode_blocks  <= kv_blocks   and  reserved_seqs + n <= 2 · max_num_seqs
    prefill: reserved_blocks + need.prefill_blocks <= kv_blocks   and  queued_tokens + prompt <= queue bound
    both:    reserved_requests < max_pending_requests (what the node itself admits)

A node with nothing reserved always takes one request (one larger than the node is refused by the node
itself, with its reason). A node that has not reported yet is not bounded.

A node that fails a call is taken out for ``retry_after_s`` and then tried again. A node the health
poll cannot connect to is also cut off from the requests in flight to it (`Node.lost`); a node that is
only slow to answer it stays in (`Node.slow_polls`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrelay.kvstore.block_key import BlockKey
from kvrelay.router.kv_index import KvIndex
from kvrelay.router.node_state import Node
from kvrelay.router.plan import LOCAL, MODES, PlanChoice, StepModel, TtftCalibration, choose_plan, running, whole_plan

PREFILL_QUEUE_STEPS = 4  # prompt tokens placed on a prefill node, in steps of its token budget
# Samples placed on a decode node, in multiples of its batch (max_num_seqs): those beyond the batch are being
# prefilled and pulled, or wait in the node's scheduler with their KV pulled, so the batch stays full.
DECODE_SEQS_PER_SLOT = 2


class NodeLost(Exception):
    """Raised into the reads of answers from a node that the health poll found unreachable."""


@dataclass(frozen=True, slots=True)
class Need:
    """What one generation request holds while it runs, in the units nodes report.

    ``prefill_blocks``: on its prefill node from prefill until the decode node has pulled the KV;
    ``decode_blocks``: on its decode node for its whole life (prompt plus the output it is expected to
    keep); ``seqs``: its samples (``n``); ``decode_tokens``: the output it is expected to decode (a sample's).
    """

    prompt_tokens: int
    prefill_blocks: int
    decode_blocks: int
    seqs: int
    decode_tokens: int = 0  # the output tokens it is expected to decode (0: not weighed, `router.plan.whole_plan`)
    # its prompt is prefilled on a prefill node whatever router.disaggregation says: that node computes the
    # prompt's logprobs (vLLM's prompt_logprobs) and answers them; a decode node's answer has no room for them
    needs_prefill_node: bool = False

    def fits_decode(self, node: Node) -> bool:
        cap = node.capacity
        if cap is None or (node.reserved_blocks == 0 and node.reserved_seqs == 0):
            return True
        return (node.reserved_blocks + self.decode_blocks <= cap.kv_blocks
                and node.reserved_seqs + self.seqs <= DECODE_SEQS_PER_SLOT * cap.max_num_seqs
                and node.reserved_requests < cap.max_pending_requests)

    def fits_local(self, node: Node) -> bool:
        """Room on decode node ``node`` to prefill this prompt itself (a local plan), bounded as a prefill
        node's queue is."""
        cap = node.capacity
        return cap is None or node.queued_tokens == 0 or \
            node.queued_tokens + self.prompt_tokens <= PREFILL_QUEUE_STEPS * cap.max_num_batched_tokens

    def fits_prefill(self, node: Node) -> bool:
        cap = node.capacity
        if cap is None or (node.reserved_blocks == 0 and node.queued_tokens == 0):
            return True
        return (node.reserved_blocks + self.prefill_blocks <= cap.kv_blocks
                and node.queued_tokens + self.prompt_tokens <= PREFILL_QUEUE_STEPS * cap.max_num_batched_tokens
                and node.reserved_requests < cap.max_pending_requests)


class Reservation:
    """Room held for one request on its decode node (and prefill node, when it has one) from placement
    until `release`. The prompt's tokens leave the queue of the node that prefills it (the prefill node, or
    the decode node itself under a local plan) when `prefilled`; its blocks leave the prefill node when
    `pulled` (the decode node has the KV: the prefill node's lease is over). Each step is idempotent.
    ``choice``: the plan it was placed by (`router.plan`)."""

    def __init__(self, need: Need, decode: Node, prefill: Node | None, choice: PlanChoice | None = None) -> None:
        self.need = need
        self.decode: Node = decode
        self.prefill: Node | None = prefill
        self.choice = choice
        self._queue: Node = prefill if prefill is not None else decode  # the node that prefills it
        self._queued = True
        self._pinned = prefill is not None
        self._held = True
        decode.reserved_blocks += need.decode_blocks
        decode.reserved_seqs += need.seqs
        decode.reserved_requests += 1
        self._queue.queued_tokens += need.prompt_tokens
        if prefill is not None:
            prefill.reserved_blocks += need.prefill_blocks
            prefill.reserved_requests += 1

    def prefilled(self) -> None:
        if self._queued:
            self._queued = False
            self._queue.queued_tokens -= self.need.prompt_tokens
            if self.prefill is not None:
                self.prefill.reserved_requests -= 1

    def pulled(self) -> None:
        self.prefilled()
        if self._pinned and self.prefill is not None:
            self._pinned = False
            self.prefill.reserved_blocks -= self.need.prefill_blocks

    def release(self) -> None:
        self.pulled()
        if self._held:
            self._held = False
            self.decode.reserved_blocks -= self.need.decode_blocks
            self.decode.reserved_seqs -= self.need.seqs
            self.decode.reserved_requests -= 1


class NodeSet:
    """Owned by the router's event loop."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], *, block_size_tokens: int,
                 load_weight_tokens: int = 64, retry_after_s: float = 5.0, disaggregation: str = "always",
                 tpot_slo_s: float = 0.0, ttft_slo_s: float = 0.0) -> None:
        """``disaggregation``: how `place` chooses between a prefill node and the decode node itself
        (`router.plan.MODES`); ``tpot_slo_s`` / ``ttft_slo_s``: the SLOs `router.plan.choose_plan` weighs the
        plans by under ``auto`` (0: none).

        Raises:
            ValueError: an unknown ``disaggregation``.
        """
        if disaggregation not in MODES:
            raise ValueError(f"disaggregation must be one of {', '.join(MODES)}, got {disaggregation!r}")
        self.disaggregation = disaggregation
        self.tpot_slo_s = tpot_slo_s
        self.ttft_slo_s = ttft_slo_s
        self.calibration = TtftCalibration()  # the plans' TTFT model against what the router measured
        self.prefill = [Node(f"prefill-{i}", u.rstrip("/"), "prefill") for i, u in enumerate(prefill_urls)]
        self.decode = [Node(f"decode-{i}", u.rstrip("/"), "decode") for i, u in enumerate(decode_urls)]
        self.index = KvIndex()
        self.block_size_tokens = block_size_tokens
        self.load_weight_tokens = load_weight_tokens
        self.retry_after_s = retry_after_s

    @property
    def all(self) -> list[Node]:
        return self.prefill + self.decode

    def add(self, role: str, url: str, name: str) -> Node:
        """A node found by discovery. A node of that role already named ``name`` at another URL (a pod
        restarted at a new address) is replaced."""
        nodes = self.prefill if role == "prefill" else self.decode
        for old in [n for n in nodes if n.name == name]:
            self.remove(old)
        node = Node(name, url.rstrip("/"), role)
        nodes.append(node)
        return node

    def remove(self, node: Node) -> None:
        """A node that left (discovery no longer finds it: a pod that is draining, or gone): no new
        requests. Those in flight go on (a draining pod finishes them); if it is gone, its health poll
        finds out and ends them (`mark_unreachable`)."""
        nodes = self.prefill if node.role == "prefill" else self.decode
        if any(n is node for n in nodes):
            nodes.remove(node)
            self.index.drop_node(node.name)

    def has(self, node: Node) -> bool:
        return any(n is node for n in self.all)

    def mark_down(self, node: Node, error: str = "") -> None:
        node.failures += 1
        node.times_down += node.seen
        node.last_error = error
        node.down_until = time.monotonic() + self.retry_after_s
        self.index.drop_node(node.name)

    def mark_unreachable(self, node: Node, error: str) -> None:
        """The health poll could not reach ``node``: take it out and end the requests waiting on it
        (those still waiting for an answer see `Node.lost`; reads of answers raise `NodeLost`)."""
        self.mark_down(node, error)
        node.lost.set()
        node.lost = asyncio.Event()
        for reader in list(node.readers):
            reader.set_exception(NodeLost(f"{node.name} became unreachable: {error}"))

    def mark_up(self, node: Node) -> None:
        node.seen = True
        node.failures = 0
        node.down_until = 0.0
        node.last_error = ""

    def place(self, need: Need, keys: Sequence[BlockKey]) -> Reservation | None:
        """Reserve room for a request: the best decode node with room, and — when `router.plan.choose_plan`
        under `disaggregation` picks the disaggregated plan — the best prefill node with room (none up: the decode node
        prefills it). None: no room now (or no decode node is up), so the request waits. Under ``always`` a
        request waits for a prefill node's room; under ``auto`` one whose prefill nodes are all full is
        prefilled on its decode node if that has room.

        Under ``auto``, a prefill node that serves whole requests (`NodeCapacity.whole_requests`) with room
        takes the request itself, as a decode node does under a local plan, when that breaches fewer SLOs, or as
        many at a lower cost, than the decode node's plan (`router.plan.whole_plan` against `choose_plan`, both
        weighing the request's decode, ``need.decode_tokens``: its own steps there and its row in the steps of the
        streams beside it, `router.plan.decode_cost_s`). The decode node wins a tie. Where either node has
        reported no rates yet, the less loaded one takes it (`_whole_cost`: its samples weighed as
        ``load_weight_tokens`` each, plus the prompt tokens queued on it, less the prompt tokens it holds; on the
        decode node's side also the queue of the prefill node its plan would prefill on, since the prompt waits
        there either way; the decode node wins a tie). A request that ``need.needs_prefill_node`` is placed as under
        ``always``."""
        mode = "always" if need.needs_prefill_node else self.disaggregation
        decode = self.pick_decode(keys, fits=need.fits_decode)
        if decode is not None and mode != "always":
            decode = self._priced_decode(need, keys, decode)
        whole, whole_held = self._pick_whole(keys, need) if mode == "auto" else (None, 0)
        if decode is None:
            return self._place_whole(need, whole, whole_held) if whole is not None else None
        prefill = None
        any_prefill = mode != "never" and self.any_healthy(self.prefill)
        if any_prefill:
            prefill = self.pick_prefill(keys, need.prompt_tokens, fits=need.fits_prefill)
            if prefill is None and mode == "always":
                return None
        held = self.index.prefix_blocks(keys, [decode.name, *([prefill.name] if prefill is not None else [])])
        now = time.monotonic()
        choice = choose_plan(mode, prompt_tokens=need.prompt_tokens, block_size_tokens=self.block_size_tokens,
                             decode=decode, decode_held_blocks=held[decode.name], prefill=prefill,
                             prefill_held_blocks=held[prefill.name] if prefill is not None else 0,
                             calibration=self.calibration, tpot_slo_s=self.tpot_slo_s,
                             ttft_slo_s=self.ttft_slo_s, now=now, decode_tokens=need.decode_tokens)
        if whole is not None:
            as_whole = whole_plan(whole, prompt_tokens=need.prompt_tokens, held_blocks=whole_held,
                                  block_size_tokens=self.block_size_tokens, decode_tokens=need.decode_tokens,
                                  stand_in=StepModel.of(decode), calibration=self.calibration,
                                  tpot_slo_s=self.tpot_slo_s, ttft_slo_s=self.ttft_slo_s, now=now)
            if not (math.isnan(as_whole.cost_s) or math.isnan(choice.cost_s)):
                if (as_whole.breaches, as_whole.cost_s) < (choice.breaches, choice.cost_s):
                    return Reservation(need, whole, None, as_whole)
            else:
                # Nothing to price one side by yet: the less loaded node. The decode node's side: its own load,
                # and, when its plan prefills on a prefill node, that node's queue too (the prompt waits there
                # either way)
                decode_cost = self._whole_cost(decode, held[decode.name])
                if choice.plan != LOCAL and prefill is not None:
                    decode_cost += prefill.queued_tokens
                if self._whole_cost(whole, whole_held) < decode_cost:
                    return self._place_whole(need, whole, whole_held)
        if choice.plan == LOCAL:
            if any_prefill and not need.fits_local(decode):
                return None  # a choice between nodes that are both full: wait
            prefill = None
        return Reservation(need, decode, prefill, choice)

    def _priced_decode(self, need: Need, keys: Sequence[BlockKey], first: Node) -> Node:
        """Among the healthy decode nodes with room for ``need``, the one where prefilling and decoding the request
        breaches the fewest SLOs, then costs least (`router.plan.whole_plan` on each: its queue, the stall on its
        streams, the decode it would add, the prompt tokens it holds); ``first`` (`pick_decode`'s choice) when fewer
        than two have room or any has reported no rates yet. Two aggregated replicas are placed so, as `place`
        weighs a prefill node that serves whole requests against the decode node."""
        now = time.monotonic()
        nodes = [n for n in self.decode if n.healthy(now) and need.fits_decode(n)]
        if len(nodes) < 2:
            return first
        held = self.index.prefix_blocks(keys, [n.name for n in nodes])
        priced = []
        for i, node in enumerate(nodes):
            plan = whole_plan(node, prompt_tokens=need.prompt_tokens, held_blocks=held[node.name],
                              block_size_tokens=self.block_size_tokens, decode_tokens=need.decode_tokens,
                              stand_in=None, calibration=self.calibration, tpot_slo_s=self.tpot_slo_s,
                              ttft_slo_s=self.ttft_slo_s, now=now)
            if math.isnan(plan.cost_s):
                return first
            priced.append((plan.breaches, plan.cost_s, i, node))
        return min(priced)[3]

    def _place_whole(self, need: Need, whole: Node, whole_held: int) -> Reservation:
        """Reserve ``whole`` (a prefill node that serves whole requests) as the request's decode node, prefilling
        it itself."""
        choice = choose_plan("never", prompt_tokens=need.prompt_tokens, block_size_tokens=self.block_size_tokens,
                             decode=whole, decode_held_blocks=whole_held, prefill=None, prefill_held_blocks=0,
                             calibration=self.calibration)
        return Reservation(need, whole, None, choice)

    def _pick_whole(self, keys: Sequence[BlockKey], need: Need) -> tuple[Node | None, int]:
        """The least loaded healthy prefill node that serves whole requests and has room for this one (as a
        decode node, and for its prompt), and the leading blocks of the prompt it holds; (None, 0) if none."""
        now = time.monotonic()
        nodes = [n for n in self.prefill if n.healthy(now) and n.capacity is not None and n.capacity.whole_requests
                 and need.fits_decode(n) and need.fits_local(n)]
        if not nodes:
            return None, 0
        held = self.index.prefix_blocks(keys, [n.name for n in nodes])
        node = min(enumerate(nodes), key=lambda p: (self._whole_cost(p[1], held[p[1].name]), p[0]))[1]
        return node, held[node.name]

    def _whole_cost(self, node: Node, held_blocks: int) -> int:
        """How loaded ``node`` is for taking a whole request, in prompt tokens (see `place`)."""
        return running(node) * self.load_weight_tokens + node.queued_tokens - held_blocks * self.block_size_tokens

    def any_healthy(self, nodes: Sequence[Node]) -> bool:
        now = time.monotonic()
        return any(n.healthy(now) for n in nodes)

    def pick_prefill(self, keys: Sequence[BlockKey], prompt_tokens: int, *, exclude: set[str] = frozenset(),
                     fits: Callable[[Node], bool] | None = None) -> Node | None:
        now = time.monotonic()
        nodes = [n for n in self.prefill if n.healthy(now) and n.name not in exclude and (fits is None or fits(n))]
        if not nodes:
            return None
        held = self.index.prefix_blocks(keys, [n.name for n in nodes])

        def cost(pair: tuple[int, Node]) -> tuple[int, int, int]:
            i, n = pair
            return (prompt_tokens - held[n.name] * self.block_size_tokens + n.queued_tokens, n.in_flight, i)

        return min(enumerate(nodes), key=cost)[1]

    def pick_decode(self, keys: Sequence[BlockKey], *, exclude: set[str] = frozenset(),
                    fits: Callable[[Node], bool] | None = None) -> Node | None:
        now = time.monotonic()
        nodes = [n for n in self.decode if n.healthy(now) and n.name not in exclude and (fits is None or fits(n))]
        if not nodes:
            return None
        held = self.index.prefix_blocks(keys, [n.name for n in nodes])

        def cost(pair: tuple[int, Node]) -> tuple[int, int]:
            i, n = pair
            load = max(n.in_flight, n.reserved_seqs)
            return (load * self.load_weight_tokens - held[n.name] * self.block_size_tokens, i)

        return min(enumerate(nodes), key=cost)[1]
