"""`TransferConfig`: the settings of one node's transfer layer (built by `deploy/` from YAML)."""

from __future__ import annotations

from dataclasses import dataclass

# The header that carries the deployment's internal token on every internal endpoint: the transfer
# endpoints here, and the engine nodes' API (`transfer.wire`, `node.app`, the router's backends).
TOKEN_HEADER = "X-Kvrelay-Token"
# On a decode node's answer to /generate: "ended" when the node has ended the KV handle's lease (its
# "done" or "abort" notification is sent). Absent or anything else: the lease is still open, and whoever
# forwarded the handle (the router) releases it on the prefill node.
LEASE_HEADER = "X-Kvrelay-Lease"


# Test-only faults an owner injects into the blocks it has just offered (set only by the tests' node hook,
# ``KVRELAY_TEST_PUBLISH_FAULTS`` in tests/services/hooks; no configuration key), to
# prove that readers check what they read: ``corrupt_published_block`` flips one byte of the last block;
# ``overwrite_leased_blocks`` writes other KV over every leased block, as if the lease had quietly ended
# and the slots were reused. And into the handle it hands out (the lease pins the real blocks), to prove
# that no refused handle keeps its lease: ``handle_names_absent_blocks`` (block ids past the owner's pool),
# ``handle_with_other_keys`` (keys of another prompt), ``malformed_handle`` (a handle that does not parse).
PUBLISH_FAULTS = ("corrupt_published_block", "overwrite_leased_blocks", "handle_names_absent_blocks",
                  "handle_with_other_keys", "malformed_handle")
HANDLE_FAULTS = frozenset(PUBLISH_FAULTS[2:])
# aiohttp's own idle time for a pooled client connection.
AIOHTTP_CLIENT_KEEPALIVE_S = 15.0


def client_keepalive_s(node_keepalive_s: float) -> float:
    """How long a pooled connection to a node may sit idle on the caller's side (the router's, a decode node's
    to its prefill nodes): half the node's own idle timeout (``internal.keepalive_timeout_s``), so that the
    caller always closes first and never sends a request down a connection the node is closing, and at most
    aiohttp's default (15 s). Seconds."""
    return min(AIOHTTP_CLIENT_KEEPALIVE_S, node_keepalive_s / 2)


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings of the NIXL agent, the owner's leases and the reader's waits.

    Attributes:
        agent_name: this node's NIXL agent name; unique among the nodes that talk to each other.
        backends: NIXL backends to create (``UCX`` moves DRAM and VRAM).
        lease_ttl_s: how long an owner pins blocks for a reader that neither renews nor finishes.
        handshake_timeout_s: bound on one ``GET /kv/meta``.
        renew_timeout_s: bound on one ``POST /kv/lease/renew``.
        internal_token: shared secret sent and required in `TOKEN_HEADER`; None leaves the
            endpoints open (bind them to loopback or a private address then).
        reap_interval_s: how often the owner unpins expired leases.
        notif_poll_interval_s: how often the owner drains NIXL notifications.
        inject_faults: `PUBLISH_FAULTS` to inject (tests only).
        max_quarantined_blocks: blocks a reader may hold back for abandoned reads before `pull`
            refuses new work (see `Puller`).
        node_keepalive_s: the nodes' idle-connection timeout (``internal.keepalive_timeout_s``); a reader's
            pooled connections to owners close after `client_keepalive_s` of it.
    """

    agent_name: str
    backends: tuple[str, ...] = ("UCX",)
    lease_ttl_s: float = 30.0
    handshake_timeout_s: float = 5.0
    renew_timeout_s: float = 2.0
    internal_token: str | None = None
    reap_interval_s: float = 0.5
    notif_poll_interval_s: float = 0.005
    max_quarantined_blocks: int = 1 << 20
    node_keepalive_s: float = 75.0
    inject_faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.agent_name or len(self.agent_name) > 128:
            raise ValueError(f"transfer.agent_name must be 1..128 characters, got {self.agent_name!r}")
        for name in ("lease_ttl_s", "handshake_timeout_s", "renew_timeout_s", "reap_interval_s",
                     "notif_poll_interval_s", "node_keepalive_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"transfer.{name} must be a positive number of seconds, got {value!r}")
        if self.max_quarantined_blocks < 0:
            raise ValueError(f"transfer.max_quarantined_blocks must be >= 0, got {self.max_quarantined_blocks}")
        for fault in self.inject_faults:
            if fault not in PUBLISH_FAULTS:
                raise ValueError(f"inject_faults: {fault!r} is not one of {list(PUBLISH_FAULTS)}")
