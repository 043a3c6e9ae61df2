"""`TransferError`: the one error a KV pull raises; the caller picks recompute or fail.

``reason`` is a short, stable word for metrics and logs; the message says what happened and to whom.

    reason       when
    ---------    -----------------------------------------------------------------
    handshake    /kv/meta could not be fetched or decoded in time
    mismatch     the peer's BlockSpec fingerprint or protocol version differs (PeerMismatchError)
    bad_handle   the handle names tiers or blocks the owner does not have, is inconsistent, names blocks or
                 digests the owner did not lease for its keys (the owner refused its binding), or carries no
                 digests while this node checks integrity
    no_blocks    the local pool has too few free blocks for the missing keys
    peer_gone    the owner disconnected, or restarted since it issued the handle
    read_error   NIXL reported an error for the READ
    timeout      the deadline passed before the READ completed
    lease_lost   the owner no longer holds the lease, so the bytes read cannot be trusted
    no_agent     this node has no transfer agent (it cannot pull at all)
    key_mismatch the handle's keys are not those of the request's own prompt and salt (forged or stale)
    foreign_owner the handle names an owner that is not a prefill node of this deployment
    internal     anything else went wrong while pulling (a bug: logged with its traceback)
"""

from __future__ import annotations

REASONS = frozenset(
    {"handshake", "mismatch", "bad_handle", "no_blocks", "peer_gone", "read_error", "timeout", "lease_lost",
     "no_agent", "internal", "key_mismatch", "foreign_owner"}
)


class TransferError(RuntimeError):
    """A KV pull failed. No block of the failed pull is handed to the caller. ``lease_ended``: the puller
    told the owner to drop the handle's lease ("abort" sent); False: the lease is still open for whoever
    forwarded the handle to release."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.lease_ended = False


class PeerMismatchError(TransferError):
    """The peer's BlockSpec fingerprint or protocol version differs from ours; it is refused."""

    def __init__(self, message: str) -> None:
        super().__init__("mismatch", message)
