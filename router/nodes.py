"""`NodeSet`: the router's view of its prefill and decode nodes, and the routing decision.

Prefill: the node that holds the longest prefix of the request's block keys, weighed against the
tokens it still has to compute for requests the router sent it:

    cost(node) = (prompt_tokens - cached_prefix_tokens(node)) + queued_prompt_tokens(node)

Decode: the node with the fewest in-flight requests, each weighed as ``load_weight_tokens``, minus
the prompt tokens it already holds (its own prefix cache saves a pull):

    cost(node) = in_flight(node) · load_weight_tokens - cached_prefix_tokens(node)

A node that fails a call is taken out for ``retry_after_s`` and then tried again. A node the health
poll cannot reach is also cut off from the requests in flight to it (`Node.lost`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.block_key import BlockKey
from router.kv_index import KvIndex


class NodeLost(Exception):
    """Raised into the reads of answers from a node that the health poll found unreachable."""


@dataclass(slots=True)
class Node:
    name: str
    url: str
    role: str
    in_flight: int = 0
    queued_tokens: int = 0
    down_until: float = 0.0
    failures: int = 0
    seen: bool = False  # answered at least once; until then it is polled at every round
    last_error: str = ""  # why the last call failed; cleared when it answers
    times_down: int = 0  # how often it was taken out after it had answered (never reset)
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

    def pick_prefill(self, keys: Sequence[BlockKey], prompt_tokens: int, *, exclude: set[str] = frozenset()
                     ) -> Node | None:
        now = time.monotonic()
        nodes = [n for n in self.prefill if n.healthy(now) and n.name not in exclude]
        if not nodes:
            return None
        held = self.index.prefix_blocks(keys, [n.name for n in nodes])

        def cost(pair: tuple[int, Node]) -> tuple[int, int, int]:
            i, n = pair
            return (prompt_tokens - held[n.name] * self.block_size_tokens + n.queued_tokens, n.in_flight, i)

        return min(enumerate(nodes), key=cost)[1]

    def pick_decode(self, keys: Sequence[BlockKey], *, exclude: set[str] = frozenset()) -> Node | None:
        now = time.monotonic()
        nodes = [n for n in self.decode if n.healthy(now) and n.name not in exclude]
        if not nodes:
            return None
        held = self.index.prefix_blocks(keys, [n.name for n in nodes])

        def cost(pair: tuple[int, Node]) -> tuple[int, int]:
            i, n = pair
            return (n.in_flight * self.load_weight_tokens - held[n.name] * self.block_size_tokens, i)

        return min(enumerate(nodes), key=cost)[1]
