"""Which nodes of a role exist: fixed URLs plus the addresses DNS names resolve to.

A Kubernetes headless Service (``clusterIP: None``) answers its name with one address per ready pod,
so resolving ``kvrelay-prefill.default.svc.cluster.local:8100`` again and again follows the prefill
pods as they come and go. The router uses it to find its nodes; a decode node, to know which prefill
nodes it may pull KV from. Torch-free.

    nodes = NodeAddresses(["http://10.0.0.5:8100"], ["kvrelay-prefill:8100"])
    await nodes.refresh()      # -> (added URLs, removed URLs)
    nodes.urls                 # frozenset of every URL known now
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)
Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> addresses


async def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    """Every TCP address ``host`` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def parse_dns_name(text: str) -> tuple[str, int]:
    """``host:port`` → (host, port). Raises ValueError naming the problem."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port (e.g. kvrelay-prefill.default.svc.cluster.local:8100)")
    return host, int(port)


def url_of(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class NodeAddresses:
    """The URLs of one role's nodes: ``urls`` (fixed) plus every address of each of ``dns_names``
    (``host:port``), as of the last `refresh`. A name that fails to resolve keeps its last addresses
    (a DNS hiccup must not empty the cluster; nodes that are really gone fail their health polls)."""

    def __init__(self, urls: Sequence[str], dns_names: Sequence[str] = (), *,
                 resolver: Resolver = getaddrinfo_resolver) -> None:
        self._fixed = frozenset(u.rstrip("/") for u in urls)
        self._names = [parse_dns_name(n) for n in dns_names]
        self._resolver = resolver
        self._resolved: dict[tuple[str, int], frozenset[str]] = {name: frozenset() for name in self._names}
        self.urls: frozenset[str] = self._fixed

    @property
    def dynamic(self) -> bool:
        """Whether any DNS name is followed (else `urls` never changes)."""
        return bool(self._names)

    async def refresh(self) -> tuple[set[str], set[str]]:
        """Resolve every DNS name now; returns the URLs that appeared and those that vanished."""
        for host, port in self._names:
            try:
                addresses = await self._resolver(host, port)
            except (OSError, UnicodeError) as exc:
                log.warning("resolving %s:%d failed (%s); keeping its last %d addresses", host, port, exc,
                            len(self._resolved[(host, port)]))
                continue
            self._resolved[(host, port)] = frozenset(url_of(a, port) for a in addresses)
        now = self._fixed.union(*self._resolved.values())
        added, removed = set(now - self.urls), set(self.urls - now)
        self.urls = now
        return added, removed
