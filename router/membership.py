"""`Membership`: which nodes the router has, over time, and what their caches hold.

* At start, the model and block layout from the first node that answers ``/info`` (`cluster_info`).
* One long poll per node of its ``/kv/events``, on connections of its own (`Backends.poll`): it feeds the
  KV index and is the router's health check. A node it cannot connect to is taken out and the requests
  waiting on it are ended (`router.nodes.NodeSet.mark_unreachable`); one that breaks the connection or
  answers wrongly is taken out for ``node_retry_s`` (its requests go on); one that is merely slow (connected,
  no answer in time) stays in and is counted (`Node.slow_polls`). A host that vanished without a reset is
  first slow, then unreachable: the poll after a slow one connects afresh.
* With DNS names configured, discovery every ``dns_interval_s``: a new address joins once it answers
  ``/info`` (under the name it gives itself); one that vanished gets no new requests, and its poller
  stays only while requests are in flight there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvrelay.router.backends import Backends, NodeSlow, NodeUnavailable, NodeUnreachable
from kvrelay.router.config import RouterConfig
from kvrelay.router.dispatch import ClusterInfo
from kvrelay.router.node_state import Node, NodeCapacity
from kvrelay.router.nodes import NodeSet
from kvrelay.transfer.discovery import NodeAddresses, Resolver

log = logging.getLogger(__name__)
# A node that has never answered is polled every round; say so at these failure counts (not at every try).
UNSEEN_WARN_AFTER = frozenset({50, 300, 1200})
EVENT_ANSWER_TIMEOUT_S = 5.0  # beyond the long-poll wait: a node slower than this is counted slow
SLOW_WARN_EVERY = 100  # after the first slow poll of a node, say so again every this many


class Membership:
    """The router's nodes; owned by its event loop. `cluster_info`, then `start` with the `NodeSet`
    built from it, then `stop`."""

    def __init__(self, config: RouterConfig, backends: Backends, *, resolver: Resolver,
                 on_slow: Callable[[Node], None] = lambda node: None) -> None:
        self.config = config
        self.backends = backends
        self._addresses = {"prefill": NodeAddresses(config.prefill_urls, config.prefill_dns, resolver=resolver),
                           "decode": NodeAddresses(config.decode_urls, config.decode_dns, resolver=resolver)}
        self._nodes: NodeSet | None = None
        self._on_change: Callable[[], None] = lambda: None
        self._pollers: dict[str, asyncio.Task] = {}  # node URL -> its event poller
        self._discovery: asyncio.Task | None = None
        self._on_slow = on_slow  # hears each slow poll (the router counts them in its metrics)

    def start(self, nodes: NodeSet, *, on_change: Callable[[], None] = lambda: None) -> None:
        """Poll every node of ``nodes``, and follow the DNS names if any. ``on_change()`` runs after each
        answer that may change where requests fit (a load report, a node back up)."""
        self._nodes = nodes
        self._on_change = on_change
        for node in nodes.all:
            self._start_poller(node)
        if any(a.dynamic for a in self._addresses.values()):
            self._discovery = asyncio.create_task(self._discover())

    @property
    def nodes(self) -> NodeSet:
        """The `NodeSet` given to `start`."""
        assert self._nodes is not None, "Membership.start() was not called"
        return self._nodes

    def stop(self) -> None:
        for task in (*self._pollers.values(), self._discovery):
            if task is not None:
                task.cancel()

    async def cluster_info(self) -> ClusterInfo:
        """Model and block layout from the first node that answers ``/info`` (resolving the DNS names
        again while none does)."""
        if not any(a.urls or a.dynamic for a in self._addresses.values()):
            raise RuntimeError("router: no prefill or decode nodes configured")
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            for addresses in self._addresses.values():
                await addresses.refresh()
            nodes = [Node("probe", url, "probe") for a in self._addresses.values() for url in sorted(a.urls)]
            for node in nodes:
                try:
                    info = await self.backends.get_msgpack(node, "/info")
                except NodeUnavailable:
                    continue
                if info["model"] != self.config.model_name:
                    raise RuntimeError(f"router serves model {self.config.model_name!r} but {node.url} serves "
                                       f"{info['model']!r}")
                return ClusterInfo(int(info["block_size_tokens"]), bytes(info["spec_fingerprint"]),
                                   int(info["vocab_size"]), int(info["max_model_len"]),
                                   tuple(info["eos_token_ids"]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"router: no node answered /info within {self.config.startup_timeout_s} s")
            await asyncio.sleep(0.2)

    def _start_poller(self, node: Node) -> None:
        self._pollers[node.url] = asyncio.create_task(self._poll_node(node))

    async def _discover(self) -> None:
        """Follow the DNS names: a new address joins once it answers ``/info`` (under the name it gives
        itself); an address that vanished leaves. Every ``dns_interval_s``."""
        while True:
            for role, addresses in self._addresses.items():
                try:
                    await self._discover_role(role, addresses)
                except Exception:  # noqa: BLE001 - keep following the names
                    log.exception("discovering %s nodes failed", role)
            await asyncio.sleep(self.config.dns_interval_s)

    async def _discover_role(self, role: str, addresses: NodeAddresses) -> None:
        _, removed = await addresses.refresh()
        nodes = self.nodes.prefill if role == "prefill" else self.nodes.decode
        for node in [n for n in nodes if n.url in removed]:
            log.info("%s node %s at %s left (its %d requests in flight go on)", role, node.name, node.url,
                     node.in_flight)
            self.nodes.remove(node)  # its poller stops once nothing is in flight there
        known = {n.url for n in nodes}
        for url in sorted(addresses.urls - known):
            try:
                info = await self.backends.get_msgpack(Node("new", url, role), "/info")
            except NodeUnavailable:
                continue  # not up yet: the next round asks again
            if info.get("role") != role or info.get("model") != self.config.model_name:
                log.warning("%s answers as a %s node of %r, not a %s node of %r; ignored", url, info.get("role"),
                            info.get("model"), role, self.config.model_name)
                continue
            node = self.nodes.add(role, url, str(info["node"]))  # replaces the same name at an old address
            log.info("%s node %s joined at %s", role, node.name, url)
            self._start_poller(node)

    async def _poll_node(self, node: Node) -> None:
        """Long-poll one node's ``/kv/events``: it answers at once when it has news, else after
        ``event_wait_s``; an idle cluster costs one request per node every ``event_wait_s``."""
        cfg = self.config
        while True:
            if not self.nodes.has(node) and node.in_flight == 0:  # it left the cluster, and nothing waits on it
                if self._pollers.get(node.url) is asyncio.current_task():
                    del self._pollers[node.url]
                return
            now = time.monotonic()
            if node.seen and not node.healthy(now):
                await asyncio.sleep(max(node.down_until - now, cfg.event_poll_interval_s))  # taken out: retry later
                continue
            after = self.nodes.index.node_to_last_seq.get(node.name, 0)
            wait_s = cfg.event_wait_s if node.seen else 0.0
            try:
                batch = await self.backends.poll(node, f"/kv/events?after={after}&wait_s={wait_s:g}",
                                                 timeout_s=wait_s + EVENT_ANSWER_TIMEOUT_S)
                self._apply_events(node, batch)
            except NodeSlow as exc:  # it took the connection: slow, not gone; the next poll connects afresh
                node.slow_polls += 1
                self._on_slow(node)
                if node.slow_polls % SLOW_WARN_EVERY == 1:
                    log.warning("node %s is slow (%d slow polls): %s; it stays in", node.name, node.slow_polls, exc)
            except Exception as exc:  # noqa: BLE001 - one bad node must not stop its poller
                if node.seen and node.healthy(now):
                    log.warning("node %s: %s; taken out for %.0f s", node.name, exc, cfg.node_retry_s)
                elif not node.seen and node.failures + 1 in UNSEEN_WARN_AFTER:
                    log.warning("node %s has not answered yet (%d tries): %s", node.name, node.failures + 1, exc)
                if isinstance(exc, NodeUnreachable):
                    self.nodes.mark_unreachable(node, f"{type(exc).__name__}: {exc}")
                else:  # it answered, wrongly, or broke the connection: out for a while, its requests go on
                    self.nodes.mark_down(node, f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(cfg.event_poll_interval_s)

    def _apply_events(self, node: Node, batch: Any) -> None:
        """Fold one ``/kv/events`` answer into the index. Raises on a malformed batch."""
        if not self.nodes.has(node):  # it left (its poller only waits for its requests): no routing by its KV
            return
        if batch["snapshot"] is not None:
            self.nodes.index.replace(node.name, batch["snapshot"], batch["last_seq"])
        else:
            stored = [e[2] for e in batch["events"] if e[1] == "stored"]
            removed = [e[2] for e in batch["events"] if e[1] == "removed"]
            self.nodes.index.apply(node.name, stored, removed, batch["last_seq"])
        load = batch.get("load")
        if load is not None:
            node.capacity = NodeCapacity.from_report(load)
        self.nodes.mark_up(node)
        self._on_change()
