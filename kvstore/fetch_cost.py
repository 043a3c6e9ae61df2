"""`FetchCosts`: whether a cached block is worth fetching from a lower tier, or cheaper to recompute.

A prefix hit on the host or disk tier is not free: the block is read (and, for disk, its record checked) into a
device block. On a fast accelerator with a slow disk, recomputing a prompt's blocks can beat reading them (SGLang
#26305: a storage hit at 2,450 ms against 1,725 ms recomputing). The store measures what each of its promotions
costs per tier (decayed seconds per block) and the engine tells it what computing a block of prompt costs
(`engine.step_rates`); a prefix match then loads the leading run only as far as fetching it saves time:

    gain(e) = Σ_{i<e} (recompute_s - fetch_s[tier_i])      (device blocks: fetch_s = 0)
    load the first argmax_e gain(e) blocks (the last such e on ties), compute the rest

While either side is unmeasured (no promotion from a tier yet, or no prefill step), every block is fetched: the
store cannot learn a tier's cost without using it.
"""

from __future__ import annotations

from collections.abc import Sequence

DECAY = 0.1  # weight of the newest promotion in a tier's average


class FetchCosts:
    """Decayed seconds per block promoted from each lower tier, and the engine's seconds to compute one block.
    Owned by the engine's thread (the store's caller)."""

    def __init__(self) -> None:
        self.recompute_s: float = 0.0  # set by the engine from its measured prefill rate; 0.0: unknown
        self.fetch_s: dict[str, float] = {}  # tier name -> seconds per block; absent: not measured

    def observe(self, tier: str, seconds: float) -> None:
        """One block promoted from ``tier`` in ``seconds`` (read, checked, landed)."""
        if seconds < 0:
            return
        old = self.fetch_s.get(tier)
        self.fetch_s[tier] = seconds if old is None else (1 - DECAY) * old + DECAY * seconds

    def worth_loading(self, tiers: Sequence[str]) -> int:
        """How many leading blocks of a prefix match (``tiers``: where each block of the run is) to load; the rest
        are recomputed (module docstring)."""
        if self.recompute_s <= 0:
            return len(tiers)
        best_end, best, gain = 0, 0.0, 0.0
        for i, tier in enumerate(tiers):
            gain += self.recompute_s - (0.0 if tier == "device" else self.fetch_s.get(tier, 0.0))
            if gain >= best:
                best_end, best = i + 1, gain
        return best_end
