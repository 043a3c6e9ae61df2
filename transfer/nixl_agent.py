"""`KvAgent`: this node's one NIXL agent, with its tier pools registered once.

::

    KvAgent("prefill-0", spec, [("device", device_pool), ("host", host_pool)])
      │ registers each pool tensor [num_blocks, L, P, H, B, D] once (one region per tier)
      │ prepares, per tier, a descriptor list with one descriptor per block:
      │     desc[b] = (base + b·stride, block_bytes, device id)
      │     local side ("NIXL_INIT_AGENT")  and  loopback side (own name, for local_copy)
      ├── meta                       what GET /kv/meta publishes (AgentMeta)
      ├── add_peer(meta) → PeerLink  loads a peer's NIXL metadata, prepares its tiers' lists
      ├── read(link, remote blocks, local ids) → [XferRequest]   one READ per remote tier, posted
      ├── poll / release / send_notif / get_notifs
      └── local_copy(src_tier, ids, dst_tier, ids)   loopback WRITE through the same agent

Threading: every NIXL call runs on one thread the agent owns ("nixl-<name>"), so the NIXL agent is never
entered concurrently and a ``transfer()`` that copies synchronously (UCX over shared memory posts and
copies in one call) never blocks the event loop. Async methods hop to that thread; `local_copy` blocks
its caller until the copy is done (it must not be called from that thread).

Fallback: a tier whose memory NIXL cannot register (no backend takes that memory type) is logged,
left out of `meta` (peers cannot read it), and `local_copy` moves its blocks with a plain torch copy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.transfer.errors import TransferError
from kvrelay.transfer.lease import TierBlock
from kvrelay.transfer.metadata import PROTOCOL_VERSION, AgentMeta, TierRegion
from kvrelay.transfer.nixl_progress import new_nixl_agent
from nixl import _bindings as nixl_bindings

log = logging.getLogger(__name__)
# UCX's TCP transport (hosts without RDMA) moves data in 8 KiB segments by default. With 512 KiB a READ
# between two hosts ran 2x faster: 0.29-0.34 -> 0.55-0.69 of a raw TCP stream between the same two
# network namespaces (`kvrelay bench transfer --remote`). Only the TCP transport reads these.
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}
T = TypeVar("T")

# NIXL's binding errors share no base class; check_xfer_state raises some of them (a dead peer raises
# nixlRemoteDisconnectError, an invalidated one nixlNotFoundError) instead of returning "ERR".
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(nixl_bindings, n) for n in dir(nixl_bindings) if n.startswith("nixl") and n.endswith("Error")
)
LOCAL_SIDE = "NIXL_INIT_AGENT"


@dataclass(frozen=True, slots=True)
class TierPool:
    name: str
    tensor: torch.Tensor
    region: TierRegion
    registered: bool


@dataclass(eq=False)
class PeerLink:
    """A loaded peer: its metadata and one prepared descriptor list per tier (owned by the nixl thread)."""

    meta: AgentMeta
    tier_to_dlist: dict[str, Any] = field(default_factory=dict)
    active: bool = True  # False once removed from the agent (replaced by a newer incarnation, or closed)

    @property
    def name(self) -> str:
        return self.meta.agent_name


@dataclass(eq=False)
class XferRequest:
    """One posted READ. ``state`` is ``PROC`` until NIXL reports ``DONE`` or ``ERR`` (set by `KvAgent.poll`)."""

    peer_name: str
    local_ids: tuple[int, ...]
    num_bytes: int
    handle: Any  # nixl_xfer_handle; None when posting failed
    state: str = "PROC"
    error: str | None = None
    released: bool = False

    @property
    def finished(self) -> bool:
        return self.state != "PROC"


class KvAgent:
    """One NIXL agent per node.

    Args:
        name: NIXL agent name, unique among peers.
        spec: block layout; every pool must be ``spec.pool_shape(n)`` of ``spec.torch_dtype``, contiguous.
        tiers: ``(tier name, pool tensor)`` pairs, e.g. ``[("device", dev_pool), ("host", host_pool)]``.
        backends: NIXL backends to create (``("UCX",)``); an empty tuple registers nothing (all copies
            fall back to torch).

    Raises:
        ValueError: a pool has the wrong shape, dtype or layout, or a tier is named twice.
    """

    def __init__(
        self, name: str, spec: BlockSpec, tiers: Sequence[tuple[str, torch.Tensor]], *,
        backends: Sequence[str] = ("UCX",),
    ) -> None:
        for key, value in UCX_DEFAULTS.items():  # before UCX starts; an operator's setting wins
            os.environ.setdefault(key, value)
        self.name = name
        self.spec = spec
        self.incarnation = secrets.token_hex(8)
        self._tiers: dict[str, TierPool] = {}
        for tier, tensor in tiers:
            self._check_pool(tier, tensor)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nixl-{name}")
        self._closed = False
        # Everything below is touched on the nixl thread only.
        self._agent: Any = None
        self._local_dlists: dict[str, Any] = {}
        self._loopback_dlists: dict[str, Any] = {}
        self._peers: dict[str, PeerLink] = {}
        self._stuck_handles: list[Any] = []
        try:
            self._executor.submit(self._nx_start, list(tiers), tuple(backends)).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self.meta = AgentMeta(
            version=PROTOCOL_VERSION, agent_name=name, incarnation=self.incarnation,
            nixl_metadata=self._executor.submit(self._nx_local_metadata).result(),
            spec_fingerprint=spec.fingerprint,
            tiers=tuple(p.region for p in self._tiers.values() if p.registered),
        )

    # ------------------------------------------------------------ set-up
    def _check_pool(self, tier: str, tensor: torch.Tensor) -> None:
        if tier in self._tiers:
            raise ValueError(f"tier {tier!r} is given twice")
        if tensor.dtype != self.spec.torch_dtype or tuple(tensor.shape[1:]) != self.spec.block_shape:
            raise ValueError(
                f"tier {tier!r}: pool is {tuple(tensor.shape)} {tensor.dtype}, expected "
                f"[num_blocks, *{self.spec.block_shape}] {self.spec.torch_dtype}"
            )
        if not tensor.is_contiguous() or tensor.shape[0] < 1:
            raise ValueError(f"tier {tier!r}: pool must be contiguous with at least one block")
        is_cuda = tensor.device.type == "cuda"
        region = TierRegion(
            name=tier, mem_type="VRAM" if is_cuda else "DRAM", device_id=tensor.get_device() if is_cuda else 0,
            base_addr=tensor.data_ptr(), block_bytes=self.spec.block_bytes,
            block_stride_bytes=tensor.stride(0) * tensor.element_size(), num_blocks=tensor.shape[0],
        )
        self._tiers[tier] = TierPool(tier, tensor, region, registered=False)

    def _nx_start(self, tiers: list[tuple[str, torch.Tensor]], backends: tuple[str, ...]) -> None:
        self._agent = new_nixl_agent(self.name, list(backends))
        for tier, tensor in tiers:
            pool = self._tiers[tier]
            try:
                self._agent.register_memory(tensor)
                descs = _block_descs(pool.region)
                self._local_dlists[tier] = self._agent.prep_xfer_dlist(LOCAL_SIDE, descs, pool.region.mem_type)
                self._loopback_dlists[tier] = self._agent.prep_xfer_dlist(self.name, descs, pool.region.mem_type)
            except NIXL_ERRORS as exc:
                log.warning("NIXL cannot register tier %r (%s, %s); peers cannot read it and local copies "
                            "of it use torch", tier, pool.region.mem_type, type(exc).__name__)
                continue
            self._tiers[tier] = TierPool(tier, tensor, pool.region, registered=True)

    def _nx_local_metadata(self) -> bytes:
        try:
            return self._agent.get_agent_metadata()
        except NIXL_ERRORS as exc:  # no backend that peers could reach
            log.warning("NIXL has no metadata for peers (%s): this node cannot serve reads", type(exc).__name__)
            return b""

    # ------------------------------------------------------------- queries
    @property
    def tier_names(self) -> list[str]:
        return list(self._tiers)

    def is_registered(self, tier: str) -> bool:
        return self._tiers[tier].registered

    def pool(self, tier: str) -> torch.Tensor:
        return self._tiers[tier].tensor

    # -------------------------------------------------------- thread hops
    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the nixl thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # --------------------------------------------------------------- peers
    async def add_peer(self, meta: AgentMeta) -> PeerLink:
        """Load a peer's NIXL metadata (replacing any older copy of the same agent name) and prepare a
        descriptor list per tier. Raises TransferError (``handshake``) if NIXL refuses it."""
        return await self.call(lambda: self._nx_add_peer(meta))

    async def remove_peer(self, link: PeerLink) -> None:
        """Forget a peer. Its in-flight READs then report an error (NIXL invalidates them)."""
        await self.call(lambda: self._nx_remove_peer(link))

    def _nx_add_peer(self, meta: AgentMeta) -> PeerLink:
        old = self._peers.get(meta.agent_name)
        if old is not None:
            # NIXL refuses new metadata under a loaded name (NIXL_ERR_NOT_ALLOWED): drop the old first.
            self._nx_remove_peer(old)
        for region in meta.tiers:
            if region.block_bytes != self.spec.block_bytes:
                raise TransferError("bad_handle", f"peer {meta.agent_name!r} tier {region.name!r} has "
                                    f"{region.block_bytes}-byte blocks, this node {self.spec.block_bytes}")
        link = PeerLink(meta)
        try:
            loaded = self._agent.add_remote_agent(meta.nixl_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded  # NIXL returns bytes here
            if loaded != meta.agent_name:
                self._agent.remove_remote_agent(loaded)
                raise TransferError("handshake", f"peer at /kv/meta calls itself {meta.agent_name!r} but its "
                                    f"NIXL metadata names {loaded!r}")
            self._peers[meta.agent_name] = link
            for region in meta.tiers:
                link.tier_to_dlist[region.name] = self._agent.prep_xfer_dlist(
                    meta.agent_name, _block_descs(region), region.mem_type)
        except NIXL_ERRORS as exc:
            self._nx_remove_peer(link)
            raise TransferError("handshake", f"NIXL refused peer {meta.agent_name!r}: {type(exc).__name__} "
                                f"{exc}") from None
        return link

    def _nx_remove_peer(self, link: PeerLink) -> None:
        link.active = False
        for dlist in link.tier_to_dlist.values():
            dlist.release()
        link.tier_to_dlist.clear()
        if self._peers.get(link.name) is link:
            del self._peers[link.name]
            try:
                self._agent.remove_remote_agent(link.name)
            except NIXL_ERRORS as exc:
                log.warning("removing NIXL peer %r: %s", link.name, exc)

    # --------------------------------------------------------------- reads
    async def read(
        self, link: PeerLink, remote: Sequence[TierBlock], local_tier: str, local_ids: Sequence[int],
    ) -> list[XferRequest]:
        """Post one READ per remote tier: ``remote[i]`` of the peer → block ``local_ids[i]`` of ``local_tier``.

        Returns the posted requests; a group whose posting failed comes back already in state ``ERR``.
        The caller polls, then releases every request (`release`) once it is finished.
        """
        assert len(remote) == len(local_ids)
        return await self.call(lambda: self._nx_read(link, remote, local_tier, local_ids))

    def _nx_read(
        self, link: PeerLink, remote: Sequence[TierBlock], local_tier: str, local_ids: Sequence[int],
    ) -> list[XferRequest]:
        if not link.active:  # another pull dropped this peer (it disconnected or restarted)
            raise TransferError("peer_gone", f"peer {link.name!r} was removed (disconnected or restarted)")
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for (tier, remote_id), local_id in zip(remote, local_ids, strict=True):
            remote_ids, locals_ = groups.setdefault(tier, ([], []))
            remote_ids.append(remote_id)
            locals_.append(local_id)
        out: list[XferRequest] = []
        for tier, (remote_ids, locals_) in groups.items():
            req = XferRequest(link.name, tuple(locals_), len(locals_) * self.spec.block_bytes, None)
            try:
                req.handle = self._agent.make_prepped_xfer(
                    "READ", self._local_dlists[local_tier], np.asarray(locals_, dtype=np.int32),
                    link.tier_to_dlist[tier], np.asarray(remote_ids, dtype=np.int32))
                req.state = self._agent.transfer(req.handle)
                if req.state == "ERR":
                    req.error = "NIXL reported an error posting the READ"
            except NIXL_ERRORS as exc:
                req.state, req.error = "ERR", f"{type(exc).__name__}"
            out.append(req)
        return out

    async def poll(self, xfers: Sequence[XferRequest]) -> None:
        """Refresh the state of every unfinished request (in place)."""
        await self.call(lambda: self._nx_poll(xfers))

    def _nx_poll(self, xfers: Sequence[XferRequest]) -> None:
        for req in xfers:
            if req.finished:
                continue
            try:
                req.state = self._agent.check_xfer_state(req.handle)
                if req.state == "ERR":
                    req.error = "NIXL reported a transfer error"
            except NIXL_ERRORS as exc:
                req.state, req.error = "ERR", type(exc).__name__

    async def release(self, xfers: Sequence[XferRequest]) -> None:
        """Release the NIXL handles of finished requests (each once). Unfinished ones are skipped."""
        await self.call(lambda: self._nx_release(xfers))

    def _nx_release(self, xfers: Sequence[XferRequest]) -> None:
        for req in xfers:
            if req.released or not req.finished:
                continue
            req.released = True
            if req.handle is None:
                continue
            try:
                req.handle.release()
            except NIXL_ERRORS as exc:  # NIXL keeps it on its own leak list
                log.warning("releasing a finished NIXL transfer: %s", exc)

    # ------------------------------------------------------- notifications
    async def send_notif(self, peer_name: str, message: bytes) -> bool:
        """Send a notification to a loaded peer. False if NIXL could not (peer gone); logged."""
        return await self.call(lambda: self._nx_send_notif(peer_name, message))

    async def complete(self, xfers: Sequence[XferRequest], peer_name: str, message: bytes) -> bool:
        """`release` the finished requests and `send_notif` in one hop to the nixl thread."""
        def run() -> bool:
            self._nx_release(xfers)
            return self._nx_send_notif(peer_name, message)
        return await self.call(run)

    def _nx_send_notif(self, peer_name: str, message: bytes) -> bool:
        try:
            self._agent.send_notif(peer_name, message)
            return True
        except NIXL_ERRORS as exc:
            log.warning("notification to %r failed: %s", peer_name, type(exc).__name__)
            return False

    async def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call: sender agent name → messages."""
        return await self.call(lambda: self._agent.get_new_notifs())

    # --------------------------------------------------------- local moves
    def local_copy(
        self, src_tier: str, src_ids: Sequence[int], dst_tier: str, dst_ids: Sequence[int], *,
        layers: Sequence[int] | None = None, rows: tuple[Sequence[int], Sequence[int]] | None = None,
        timeout_s: float = 30.0,
    ) -> str:
        """Copy blocks ``src_ids`` of ``src_tier`` into ``dst_ids`` of ``dst_tier`` (demotion, recall) and
        wait for it. Goes through NIXL as a loopback WRITE when both tiers are registered, else torch.

        ``layers`` (one layer index per pair): copy only that layer's slice of each block (a block is
        ``[L, P, H, B, D]``, P planes: K and V, or one latent; so a layer is one contiguous ``block_bytes / L``
        range): InfiniGen's per-layer recall. None copies whole blocks. ``rows`` (with ``layers``):
        ``(src_rows, dst_rows)``, one token row (offset in its block) per pair: copy only that token's planes of
        that layer (``P * H`` runs of ``D`` elements: one descriptor each), InfiniGen's speculative prefetch.

        Returns:
            ``"nixl"`` or ``"torch"``: the path that moved the bytes.

        Raises:
            ValueError: lengths differ or an id is out of range.
            TransferError: NIXL reported an error or the copy did not finish in ``timeout_s``; the
                destination blocks' bytes are then unknown.
        """
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
        src, dst = self._tiers[src_tier], self._tiers[dst_tier]
        for ids, pool in ((src_ids, src), (dst_ids, dst)):
            if any(not 0 <= b < pool.region.num_blocks for b in ids):
                raise ValueError(f"a block id is out of range for tier {pool.name!r} ({pool.region.num_blocks})")
        if layers is not None and (len(layers) != len(src_ids)
                                   or any(not 0 <= la < self.spec.num_layers for la in layers)):
            raise ValueError(f"layers must give one index in [0, {self.spec.num_layers}) per block pair")
        bs = self.spec.block_size_tokens
        if rows is not None and (layers is None or any(len(r) != len(src_ids) for r in rows)
                                 or any(not 0 <= x < bs for r in rows for x in r)):
            raise ValueError(f"rows needs layers and one (src, dst) row in [0, {bs}) per block pair")
        if not src_ids:
            return "nixl" if src.registered and dst.registered else "torch"
        if not (src.registered and dst.registered):
            for i, (s, d) in enumerate(zip(src_ids, dst_ids, strict=True)):
                if layers is None:
                    dst.tensor[d].copy_(src.tensor[s])
                elif rows is None:
                    dst.tensor[d, layers[i]].copy_(src.tensor[s, layers[i]])
                else:
                    dst.tensor[d, layers[i], :, :, rows[1][i]].copy_(src.tensor[s, layers[i], :, :, rows[0][i]])
            return "torch"
        assert not self._closed, "KvAgent is closed"
        if layers is None:
            self._executor.submit(self._nx_local_copy, src_tier, src_ids, dst_tier, dst_ids, timeout_s).result()
        else:
            self._executor.submit(self._nx_local_copy_layers, src, src_ids, dst, dst_ids, layers, rows,
                                  timeout_s).result()
        return "nixl"

    def _nx_local_copy_layers(
        self, src: TierPool, src_ids: Sequence[int], dst: TierPool, dst_ids: Sequence[int],
        layers: Sequence[int], rows: tuple[Sequence[int], Sequence[int]] | None, timeout_s: float,
    ) -> None:
        """Layer slices (``rows`` None) or token rows of layer slices: one descriptor per slice, or per
        (pair, plane, head) run of ``D`` elements (a slice is ``[P, H, B, D]``)."""
        spec = self.spec
        layer_bytes = spec.block_bytes // spec.num_layers
        planes = spec.num_planes * spec.num_kv_heads
        run_bytes = layer_bytes // (planes * spec.block_size_tokens)  # one token, one plane, one head: D

        def descs(pool: TierPool, ids: Sequence[int], side: int) -> np.ndarray:
            base = (np.uint64(pool.region.base_addr)
                    + np.asarray(ids, dtype=np.uint64) * np.uint64(pool.region.block_stride_bytes)
                    + np.asarray(layers, dtype=np.uint64) * np.uint64(layer_bytes))
            length = layer_bytes
            if rows is not None:  # runs (plane, head) of each pair's row: offsets plane·H·B·D + head·B·D + row·D
                runs = np.arange(planes, dtype=np.uint64) * np.uint64(spec.block_size_tokens * run_bytes)
                row = np.asarray(rows[side], dtype=np.uint64) * np.uint64(run_bytes)
                base = ((base + row)[:, None] + runs[None, :]).reshape(-1)
                length = run_bytes
            out = np.empty((base.shape[0], 3), dtype=np.uint64)
            out[:, 0] = base
            out[:, 1] = length
            out[:, 2] = pool.region.device_id
            return out

        try:
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(descs(src, src_ids, 0), src.region.mem_type),
                self._agent.get_xfer_descs(descs(dst, dst_ids, 1), dst.region.mem_type), self.name)
        except NIXL_ERRORS as exc:
            raise TransferError("read_error", f"loopback layer copy {src.name}→{dst.name} failed: "
                                f"{type(exc).__name__}") from None
        self._finish_local(handle, f"{src.name}→{dst.name}", len(src_ids), timeout_s)

    def _nx_local_copy(
        self, src_tier: str, src_ids: Sequence[int], dst_tier: str, dst_ids: Sequence[int], timeout_s: float,
    ) -> None:
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", self._local_dlists[src_tier], np.asarray(src_ids, dtype=np.int32),
                self._loopback_dlists[dst_tier], np.asarray(dst_ids, dtype=np.int32))
        except NIXL_ERRORS as exc:
            raise TransferError("read_error", f"loopback copy {src_tier}→{dst_tier} failed: "
                                f"{type(exc).__name__}") from None
        self._finish_local(handle, f"{src_tier}→{dst_tier}", len(src_ids), timeout_s)

    def _finish_local(self, handle: Any, what: str, num: int, timeout_s: float) -> None:
        """Post a loopback transfer and wait for it. Raises TransferError (error or timeout)."""
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
        except NIXL_ERRORS as exc:
            raise TransferError("read_error", f"loopback copy {what} failed: {type(exc).__name__}") from None
        if state == "PROC":
            # Still copying: keep the handle alive (released at close) rather than free it mid-copy.
            self._stuck_handles.append(handle)
            raise TransferError("timeout", f"loopback copy {what} of {num} blocks did not finish in {timeout_s}s")
        handle.release()
        if state != "DONE":
            raise TransferError("read_error", f"loopback copy {what} reported {state}")

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        """Forget every peer and stop the nixl thread. Idempotent. In-flight READs are abandoned."""
        if self._closed:
            return
        self._closed = True

        def teardown() -> None:
            for link in list(self._peers.values()):
                self._nx_remove_peer(link)
            for dlist in [*self._local_dlists.values(), *self._loopback_dlists.values()]:
                dlist.release()
            self._local_dlists.clear()
            self._loopback_dlists.clear()
            for handle in self._stuck_handles:
                try:
                    handle.release()
                except NIXL_ERRORS as exc:
                    log.warning("releasing a stuck loopback copy at close: %s", exc)
            self._stuck_handles.clear()

        self._executor.submit(teardown).result()
        self._executor.shutdown(wait=True)


def _block_descs(region: TierRegion) -> np.ndarray:
    """``[num_blocks, 3]`` uint64 rows ``(addr, block_bytes, device id)``: one descriptor per block."""
    descs = np.empty((region.num_blocks, 3), dtype=np.uint64)
    offsets = np.arange(region.num_blocks, dtype=np.uint64) * np.uint64(region.block_stride_bytes)
    descs[:, 0] = np.uint64(region.base_addr) + offsets
    descs[:, 1] = region.block_bytes
    descs[:, 2] = region.device_id
    return descs
