"""`NodeSet`: the router's view of its prefill and decode nodes, and the routing decision.

Prefill: the node that holds the longest prefix of the request's block keys, weighed against the
tokens it still has to compute for requests the router sent it:

    cost(node) = (prompt_tokens - cached_prefix_tokens(node)) + queued_prompt_tokens(node)

Decode: the node with the fewest requests placed or in flight there, each weighed as
``load_weight_tokens``, minus the prompt tokens it already holds (its own prefix cache saves a pull):

    cost(node) = max(in_flight, reserved_seqs)(node) · load_weight_tokens - cached_prefix_tokens(node)

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.block_key import BlockKey
from router.kv_index import KvIndex

PREFILL_QUEUE_STEPS = 4  # prompt tokens placed on a prefill node, in steps of its token budget
# Samples placed on a decode node, in multiples of its batch (max_num_seqs): those beyond the batch are being
# prefilled and pulled, or wait in the node's scheduler with their KV pulled, so the batch stays full.
DECODE_SEQS_PER_SLOT = 2


class NodeLost(Exception):
    """Raised into the reads of answers from a node that the health poll found unreachable."""


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What a node reports about itself in its event answers (``load``: `node.app.EngineNode.load_report`).

    ``prefill_tokens_per_s`` and ``decode_step_s`` are measured by the node (`engine.step_rates`); 0.0 until
    it has run a step of that kind.
    """

    kv_blocks: int
    free_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_tokens_per_s: float
    decode_step_s: float
    max_pending_requests: int = 1 << 30  # what the node admits at once (it answers 429 beyond)

    @classmethod
    def from_report(cls, report: Any) -> NodeCapacity:
        """Raises ValueError for a malformed report."""
        try:
            cap = cls(int(report["kv_blocks"]), int(report["free_blocks"]), int(report["max_num_seqs"]),
                      int(report["max_num_batched_tokens"]), float(report["prefill_tokens_per_s"]),
                      float(report["decode_step_s"]), int(report.get("max_pending_requests", 1 << 30)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed load report: {exc!r}") from None
        if min(cap.kv_blocks, cap.max_num_seqs, cap.max_num_batched_tokens, cap.max_pending_requests) < 1 or \
                cap.free_blocks < 0 or \
                not (cap.prefill_tokens_per_s >= 0 and cap.decode_step_s >= 0):
            raise ValueError(f"load report out of range: {cap}")
        return cap


@dataclass(frozen=True, slots=True)
class Need:
    """What one generation request holds while it runs, in the units nodes report.

    ``prefill_blocks``: on its prefill node from prefill until the decode node has pulled the KV;
    ``decode_blocks``: on its decode node for its whole life (prompt plus the output it is expected to
    keep); ``seqs``: its samples (``n``).
    """

    prompt_tokens: int
    prefill_blocks: int
    decode_blocks: int
    seqs: int

    def fits_decode(self, node: Node) -> bool:
        cap = node.capacity
        if cap is None or (node.reserved_blocks == 0 and node.reserved_seqs == 0):
            return True
        return (node.reserved_blocks + self.decode_blocks <= cap.kv_blocks
                and node.reserved_seqs + self.seqs <= DECODE_SEQS_PER_SLOT * cap.max_num_seqs
                and node.reserved_requests < cap.max_pending_requests)

    def fits_prefill(self, node: Node) -> bool:
        cap = node.capacity
        if cap is None or (node.reserved_blocks == 0 and node.queued_tokens == 0):
            return True
        return (node.reserved_blocks + self.prefill_blocks <= cap.kv_blocks
                and node.queued_tokens + self.prompt_tokens <= PREFILL_QUEUE_STEPS * cap.max_num_batched_tokens
                and node.reserved_requests < cap.max_pending_requests)


class Reservation:
    """Room held for one request on its decode node (and prefill node, when it has one) from placement
    until `release`. The prompt's tokens leave the prefill node's queue when `prefilled`; its blocks when
    `pulled` (the decode node has the KV: the prefill node's lease is over). Each step is idempotent."""

    def __init__(self, need: Need, decode: Node, prefill: Node | None) -> None:
        self.need = need
        self.decode: Node = decode
        self.prefill: Node | None = prefill
        self._queued = self._pinned = prefill is not None
        self._held = True
        decode.reserved_blocks += need.decode_blocks
        decode.reserved_seqs += need.seqs
        decode.reserved_requests += 1
        if prefill is not None:
            prefill.reserved_blocks += need.prefill_blocks
            prefill.queued_tokens += need.prompt_tokens
            prefill.reserved_requests += 1

    def prefilled(self) -> None:
        if self._queued and self.prefill is not None:
            self._queued = False
            self.prefill.queued_tokens -= self.need.prompt_tokens
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


@dataclass(slots=True)
class Node:
    name: str
    url: str
    role: str
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens placed here and not yet prefilled (`Reservation`)
    reserved_blocks: int = 0  # KV blocks the router's placed requests hold here (`Reservation`)
    reserved_seqs: int = 0  # samples the router's placed requests run here (decode nodes)
    reserved_requests: int = 0  # placed requests the node is serving (a prefill node: until it answers)
    capacity: NodeCapacity | None = None  # the node's last load report; None until it reports
    down_until: float = 0.0
    failures: int = 0
    seen: bool = False  # answered at least once; until then it is polled at every round
    last_error: str = ""  # why the last call failed; cleared when it answers
    times_down: int = 0  # how often it was taken out after it had answered (never reset)
    slow_polls: int = 0  # health polls it took but did not answer in time (it stays in; never reset)
    # Set when the health poll finds the node unreachable, and at once replaced by a fresh one: the
    # requests waiting on it then give up (`router.backends.Backends`) instead of waiting out their read
    # timeout on a host that is gone (it sends no reset); later requests wait on the fresh one.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    # Answers being read from the node now (aiohttp stream readers); `NodeSet.mark_unreachable` ends them.
    readers: set[Any] = field(default_factory=set)

    def healthy(self, now: float) -> bool:
        return now >= self.down_until


class NodeSet:
    """Owned by the router's event loop."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], *, block_size_tokens: int,
                 load_weight_tokens: int = 64, retry_after_s: float = 5.0) -> None:
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
        """Reserve room for a request: the best decode node with room, and the best prefill node with room
        when any prefill node is up (none up: the decode node prefills it). None: no room now (or no decode
        node is up), so the request waits."""
        decode = self.pick_decode(keys, fits=need.fits_decode)
        if decode is None:
            return None
        prefill = None
        if self.any_healthy(self.prefill):
            prefill = self.pick_prefill(keys, need.prompt_tokens, fits=need.fits_prefill)
            if prefill is None:
                return None
        return Reservation(need, decode, prefill)

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
