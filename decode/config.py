"""Decode-node settings (no torch: `deploy.config` checks YAML against these before anything loads)."""

from __future__ import annotations

from dataclasses import dataclass

FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Decode-only settings. ``on_transfer_failure``: ``recompute`` the prompt here, or ``fail`` the request."""

    on_transfer_failure: str = "recompute"
    transfer_timeout_s: float = 10.0
    # The prefill nodes (their URLs) a handle may name as its owner; empty: any (tests of one node).
    allowed_owners: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}, got {self.on_transfer_failure!r}")
