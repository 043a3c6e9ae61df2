"""Decode-node settings (no torch: `deploy.config` checks YAML against these before anything loads)."""

from __future__ import annotations

from dataclasses import dataclass

FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Decode-only settings. ``on_transfer_failure``: ``recompute`` the prompt here, or ``fail`` the request."""

    on_transfer_failure: str = "recompute"
    transfer_timeout_s: float = 10.0
    # The prefill nodes (their URLs, no trailing slash) a handle may name as its owner; None: any (tests
    # of one node); empty: none (a deployment without prefill nodes recomputes every prompt).
    allowed_owners: frozenset[str] | None = None
    # host:port names whose addresses are prefill nodes too (the router's prefill_dns); with allowed_owners
    owner_dns: tuple[str, ...] = ()
    # A router that takes longer than this to take one frame (it stopped reading) is dropped and the request
    # aborted (its blocks freed). Above the router's own router.write_stall_timeout_s, which drops a stalled
    # client first.
    write_stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.allowed_owners is not None:
            object.__setattr__(self, "allowed_owners", frozenset(u.rstrip("/") for u in self.allowed_owners))
        if not self.write_stall_timeout_s > 0:
            raise ValueError(f"write_stall_timeout_s must be > 0 seconds, got {self.write_stall_timeout_s!r}")
        if self.on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}, got {self.on_transfer_failure!r}")
