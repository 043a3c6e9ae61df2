"""`PeerCache`: the reader's view of owners — handshake on first contact, cached per owner URL.

::

    link(handle)
      ├─ cached link for handle.owner_url with handle's agent name and incarnation? ──▶ it
      └─ else GET {owner_url}/kv/meta (bounded, token header) → AgentMeta
             ├─ version or fingerprint differs ──▶ PeerMismatchError (names both)
             ├─ its name is ours, or a live node at another URL has it ──▶ PeerMismatchError (names both)
             ├─ new agent or incarnation: drop the old NIXL peer, load the new one (no stale addresses)
             └─ handle's incarnation is not the one serving now ──▶ TransferError("peer_gone")

A peer restart shows up as a new incarnation (and new NIXL metadata) at the same URL or under the same
agent name; the old remote agent is removed before the new one is added. Removing it ends the old
incarnation's in-flight READs with an error, which is safe only because that process is gone.

Also the reader's one other call to owners: ``POST /kv/lease/renew``.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from kvrelay.transfer.config import TOKEN_HEADER, TransferConfig
from kvrelay.transfer.errors import PeerMismatchError, TransferError
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.metadata import PROTOCOL_VERSION, AgentMeta, check_compatible
from kvrelay.transfer.nixl_agent import KvAgent, PeerLink
from kvrelay.transfer.wire import (
    MAX_META_BYTES,
    MAX_SMALL_MESSAGE_BYTES,
    WireError,
    WireVersionError,
    decode_meta,
    decode_renew_reply,
    encode_renew_request,
    read_body,
)

log = logging.getLogger(__name__)


class PeerCache:
    """Owner URL → `PeerLink`, filled by handshakes.

    Args:
        agent: this node's agent; peers are loaded into it.
        session: aiohttp session for ``/kv/meta`` and lease renewals (the caller owns and closes it).
        config: ``internal_token``, ``handshake_timeout_s``.
    """

    def __init__(self, agent: KvAgent, session: aiohttp.ClientSession, *, config: TransferConfig) -> None:
        self._agent = agent
        self._session = session
        self._config = config
        self._headers = {TOKEN_HEADER: config.internal_token} if config.internal_token else {}
        # Owned by PeerCache alone (event loop thread).
        self._url_to_link: dict[str, PeerLink] = {}
        self._url_to_lock: dict[str, asyncio.Lock] = {}
        self.num_handshakes = 0

    def cached(self, owner_url: str) -> PeerLink | None:
        return self._url_to_link.get(owner_url)

    async def link(self, handle: KvHandle, *, timeout_s: float) -> PeerLink:
        """The loaded peer that issued ``handle``, handshaking if needed (within ``timeout_s``).

        Raises:
            PeerMismatchError: the peer's fingerprint or protocol version differs.
            TransferError: ``handshake`` (unreachable, bad status, malformed metadata, timeout) or
                ``peer_gone`` (the owner restarted since it issued the handle).
        """
        url = handle.owner_url
        link = self._current(url, handle)
        if link is not None:
            return link
        try:
            link = await asyncio.wait_for(self._locked_handshake(url, handle, timeout_s), timeout_s)
        except asyncio.TimeoutError:
            raise TransferError("handshake", f"handshake with {url} did not finish within {timeout_s:.3g}s") from None
        if link.name != handle.owner_agent or link.meta.incarnation != handle.owner_incarnation:
            raise TransferError(
                "peer_gone", f"the handle was issued by {handle.owner_agent!r} incarnation {handle.owner_incarnation}, "
                f"but {url} now serves {link.name!r} incarnation {link.meta.incarnation}: the owner restarted "
                "and its lease is gone")
        return link

    def _current(self, url: str, handle: KvHandle) -> PeerLink | None:
        link = self._url_to_link.get(url)
        if link is None or not link.active:
            return None  # never loaded, or replaced in the agent under the same name
        if link.name == handle.owner_agent and link.meta.incarnation == handle.owner_incarnation:
            return link
        return None

    async def _locked_handshake(self, url: str, handle: KvHandle, timeout_s: float) -> PeerLink:
        async with self._url_to_lock.setdefault(url, asyncio.Lock()):
            link = self._current(url, handle)
            return link if link is not None else await self._handshake(url, timeout_s)

    async def _handshake(self, url: str, timeout_s: float) -> PeerLink:
        meta_url = url + "/kv/meta"
        try:
            async with self._session.get(meta_url, headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await read_body(resp.content, max_bytes=MAX_META_BYTES, what=f"GET {meta_url}")
                if resp.status != 200:
                    raise TransferError("handshake", f"GET {meta_url} answered {resp.status}: "
                                        f"{body[:200].decode('utf-8', 'replace')}")
            meta = decode_meta(body)
        except WireVersionError as exc:
            raise PeerMismatchError(f"peer at {url} speaks transfer protocol v{exc.version}, this node "
                                    f"v{PROTOCOL_VERSION}; run the same kvrelay version on both") from None
        except WireError as exc:
            raise TransferError("handshake", f"malformed metadata from {meta_url}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise TransferError("handshake", f"GET {meta_url} failed: {type(exc).__name__}: {exc}") from None
        check_compatible(self._agent.spec.fingerprint, meta, url=url)
        if meta.agent_name == self._agent.name:
            raise PeerMismatchError(f"the node at {url} is named {meta.agent_name!r}, as is this node; "
                                    "give every node its own --name")
        for known in self._url_to_link.values():
            if known.active and known.meta == meta:  # same process (a stale handle, or a second URL)
                self._url_to_link[url] = known
                return known
        await self._check_name_unique(url, meta, timeout_s)
        old = self._url_to_link.pop(url, None)
        if old is not None and old.active and old.name != meta.agent_name:
            await self._agent.remove_peer(old)
        link = await self._agent.add_peer(meta)  # replaces an older copy of the same agent name
        for other_url, other in list(self._url_to_link.items()):
            if other.name == meta.agent_name:
                del self._url_to_link[other_url]
        self._url_to_link[url] = link
        self.num_handshakes += 1
        log.info("handshake with %s: agent %r incarnation %s, tiers %s", url, meta.agent_name, meta.incarnation,
                 [t.name for t in meta.tiers])
        return link

    async def _check_name_unique(self, url: str, meta: AgentMeta, timeout_s: float) -> None:
        """Refuse ``meta`` if a live node at another URL already goes by its name (two nodes started with
        one ``--name``: their NIXL peers would keep replacing each other). A node that restarted at a new
        address (a pod's new IP) no longer answers with that name at the old one, and passes.

        Raises:
            PeerMismatchError: naming both URLs.
        """
        for other_url, other in list(self._url_to_link.items()):
            if other_url == url or other.name != meta.agent_name or not other.active:
                continue
            try:
                async with self._session.get(other_url + "/kv/meta", headers=self._headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    body = await read_body(resp.content, max_bytes=MAX_META_BYTES, what=f"GET {other_url}/kv/meta")
                still = resp.status == 200 and decode_meta(body).agent_name == meta.agent_name
            except (aiohttp.ClientError, asyncio.TimeoutError, WireError):
                still = False
            if still:
                raise PeerMismatchError(f"two nodes are named {meta.agent_name!r}: the one at {other_url} and "
                                        f"the one at {url}; give every node its own --name")

    async def forget(self, link: PeerLink) -> None:
        """Drop a peer whose connection broke: remove it from the agent (its in-flight READs then end with
        an error) and from the cache, so the next `link` to its URL handshakes again."""
        for url, cached in list(self._url_to_link.items()):
            if cached is link:
                del self._url_to_link[url]
        if link.active:
            await self._agent.remove_peer(link)

    async def renew(self, handle: KvHandle, *, timeout_s: float) -> float | None:
        """Renew the handle's lease, naming the handle's binding (`transfer.handle`). Returns the owner's new
        ttl in seconds, or None if the lease is gone.

        Raises:
            TransferError: ``bad_handle`` (409: the owner leased other blocks or digests for these keys than
                the handle names), ``peer_gone`` (connection refused or dropped: the owner is down), ``timeout``,
                or ``lease_lost`` for a malformed answer or an unexpected status (the lease cannot be confirmed).
        """
        try:
            async with self._session.post(handle.renew_url,
                                          data=encode_renew_request(handle.lease_id, handle.binding),
                                          headers=self._headers,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await read_body(resp.content, max_bytes=MAX_SMALL_MESSAGE_BYTES, what="lease renew reply")
                if resp.status == 404:
                    return None
                if resp.status == 409:
                    raise TransferError("bad_handle", f"owner {handle.owner_agent!r} refused to confirm the KV "
                                        f"handle: {body[:300].decode('utf-8', 'replace')}")
                if resp.status != 200:
                    raise TransferError("lease_lost", f"POST {handle.renew_url} answered {resp.status}: "
                                        f"{body[:200].decode('utf-8', 'replace')}")
                return decode_renew_reply(body)
        except asyncio.TimeoutError:  # before ClientConnectionError: ServerTimeoutError is both
            raise TransferError("timeout", f"lease renew at {handle.owner_url} took over {timeout_s:.3g}s") from None
        except aiohttp.ClientConnectionError as exc:
            raise TransferError("peer_gone", f"owner at {handle.owner_url} is unreachable: "
                                f"{type(exc).__name__}: {exc}") from None
        except (aiohttp.ClientError, WireError) as exc:
            raise TransferError("lease_lost", f"lease renew at {handle.owner_url} failed: {exc}") from None

    async def close(self) -> None:
        """Remove every cached peer from the agent."""
        for link in self._url_to_link.values():
            await self._agent.remove_peer(link)
        self._url_to_link.clear()
