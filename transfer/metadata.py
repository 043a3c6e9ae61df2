"""`AgentMeta`: what a node publishes at ``GET /kv/meta`` so peers can READ its blocks.

::

    AgentMeta(version=1, agent_name="prefill-0", incarnation="9f3a…",   # new at every start
              nixl_metadata=b"…",                                       # get_agent_metadata()
              spec_fingerprint=b"<32 bytes>",                           # BlockSpec.fingerprint
              tiers=(TierRegion("device", "DRAM", device_id=0, base_addr=0x7f…, block_bytes=65536,
                                block_stride_bytes=65536, num_blocks=4096), …))

    block b of a tier = bytes [base_addr + b·block_stride_bytes, … + block_bytes)

A reader refuses a peer whose fingerprint or protocol version differs from its own
(`check_compatible`). ``incarnation`` changes when the owner restarts, so a reader can tell a restarted
peer (new NIXL metadata, new addresses) from the one it handshook with.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.transfer.errors import PeerMismatchError

PROTOCOL_VERSION = 2  # 2: a lease renewal names the binding of the handle (transfer.handle)


@dataclass(frozen=True, slots=True)
class TierRegion:
    """One registered pool: ``num_blocks`` blocks of ``block_bytes``, ``block_stride_bytes`` apart."""

    name: str
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    base_addr: int
    block_bytes: int
    block_stride_bytes: int
    num_blocks: int

    def block_addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_stride_bytes


@dataclass(frozen=True, slots=True)
class AgentMeta:
    version: int
    agent_name: str
    incarnation: str
    nixl_metadata: bytes
    spec_fingerprint: bytes
    tiers: tuple[TierRegion, ...]

    def tier(self, name: str) -> TierRegion | None:
        for region in self.tiers:
            if region.name == name:
                return region
        return None


def check_compatible(local_fingerprint: bytes, meta: AgentMeta, *, url: str) -> None:
    """Refuse a peer built for another model or layout, or speaking another protocol version.

    Raises:
        PeerMismatchError: naming both fingerprints (hex) or both versions, and the peer.
    """
    if meta.version != PROTOCOL_VERSION:
        raise PeerMismatchError(
            f"peer {meta.agent_name!r} at {url} speaks transfer protocol v{meta.version}, this node v"
            f"{PROTOCOL_VERSION}; run the same kvrelay version on both"
        )
    if meta.spec_fingerprint != local_fingerprint:
        raise PeerMismatchError(
            f"peer {meta.agent_name!r} at {url} has BlockSpec fingerprint {meta.spec_fingerprint.hex()}, "
            f"this node has {local_fingerprint.hex()}; both must serve the same model with the same "
            "KV layout (layers, kv heads, head dim, block size, dtype)"
        )
