"""`LongContextConfig`: how a decode sequence keeps its KV within a device budget (docs/design.md §7).

Three policies, picked per deployment (``decode.long_context``) and per request (the API's
``kvrelay.long_context`` field, merged with `LongContextConfig.with_overrides`):

* ``none`` — full attention; every token's KV stays on device.
* ``h2o`` — permanent eviction: beyond ``device_budget_tokens``, the tokens with the lowest
  accumulated attention outside the first ``sink_tokens`` and the last ``recent_tokens`` are dropped.
* ``infinigen`` — offload and recall: beyond the budget, whole cold blocks move to the host tier and
  come back into ``recall_blocks`` staging blocks, per layer, before attention. Nothing is lost. What
  comes back is picked by ``selection``:

  * ``blocks`` — at every layer the blocks whose key summaries (Quest-style min/max) score highest
    against that layer's query, copied synchronously (`engine.infinigen`);
  * ``speculative`` — as the InfiniGen paper: while layer ``i`` runs, the tokens layer ``i+1`` will
    attend to are guessed from a partial query and a partial key cache in a few skewed channels
    (``partial_channels_frac`` of the head dimension; `model.skew`), and those within
    ``speculation_alpha`` of the best are prefetched into the staging rows (`engine.infinigen_speculative`).

The budget counts whole blocks: a sequence holds at most ``device_budget_tokens // B`` device blocks
in every decode step (its prompt is on device while it is prefilled).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

POLICIES = ("none", "h2o", "infinigen")
SELECTIONS = ("blocks", "speculative")
COUNTS = ("device_budget_tokens", "sink_tokens", "recent_tokens", "recall_blocks")
# What a request may set (``kvrelay.long_context``); ``partial_channels_frac`` is the deployment's: the skew
# tables are made for one fraction.
OVERRIDABLE = ("policy", *COUNTS, "selection", "speculation_alpha")
# 24 of 64 channels on SmolLM2: InfiniGen's Llama setup keeps the union of the query's and the key's top 20%
# (up to 40%); on the passkey task 0.25 lost digits that 0.375 keeps (docs/concepts/long-context.md).
DEFAULT_PARTIAL_CHANNELS_FRAC = 0.375
DEFAULT_SPECULATION_ALPHA = 4.0  # InfiniGen's speed-up runs; 5 in its accuracy runs


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class LongContextConfig:
    """One sequence's long-context policy.

    Attributes:
        policy: ``none`` | ``h2o`` | ``infinigen``.
        device_budget_tokens: KV a sequence may keep on device, in tokens (whole blocks count).
        sink_tokens: the first tokens, always kept on device (attention sinks).
        recent_tokens: the last tokens, always kept on device.
        recall_blocks: ``infinigen``: staging blocks, i.e. blocks (``blocks``) or ``recall_blocks * B``
            tokens (``speculative``) of offloaded KV each layer attends to per step.
        selection: ``infinigen``: ``blocks`` | ``speculative`` (see the module doc).
        speculation_alpha: ``speculative``: fetch the offloaded tokens whose speculated logit
            (``q·k / sqrt(D)``, natural log units) is within this margin of the best one.
        partial_channels_frac: ``speculative``: the share of each head's channels in the partial key cache.

    Raises:
        ValueError: naming the field, for a wrong type or range.
    """

    policy: str = "none"
    device_budget_tokens: int = 4096
    sink_tokens: int = 16
    recent_tokens: int = 64
    recall_blocks: int = 4
    selection: str = "blocks"
    speculation_alpha: float = DEFAULT_SPECULATION_ALPHA
    partial_channels_frac: float = DEFAULT_PARTIAL_CHANNELS_FRAC

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"long_context.policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"long_context.selection: {self.selection!r} is not one of {', '.join(SELECTIONS)}")
        alpha = self.speculation_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < float("inf"):
            raise ValueError(f"long_context.speculation_alpha: must be a finite number >= 0, got {alpha!r}")
        frac = self.partial_channels_frac
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
            raise ValueError(f"long_context.partial_channels_frac: must be in (0, 1], got {frac!r}")
        for name in COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
                raise ValueError(f"long_context.{name}: must be an integer in [0, 2**31), got {value!r}")
        if self.device_budget_tokens == 0:
            raise ValueError("long_context.device_budget_tokens: must be positive")

    @property
    def active(self) -> bool:
        return self.policy != "none"

    @property
    def speculative(self) -> bool:
        """InfiniGen with speculative selection (needs the model's skew tables)."""
        return self.policy == "infinigen" and self.selection == "speculative"

    def budget_blocks(self, block_size_tokens: int) -> int:
        return self.device_budget_tokens // block_size_tokens

    def check(self, block_size_tokens: int) -> None:
        """Raises ValueError when the budget cannot hold what the policy always keeps.

        ``h2o`` evicts down to one block below the budget and keeps sink + recent tokens there;
        ``infinigen`` keeps the sink blocks, ``recall_blocks`` staging blocks, the blocks covering
        the recent tokens, and the block the next token is written to.
        """
        if not self.active:
            return
        bs = block_size_tokens
        blocks = self.budget_blocks(bs)
        if self.policy == "h2o":
            room, kept = (blocks - 1) * bs, self.sink_tokens + self.recent_tokens
            if room < kept:
                raise ValueError(
                    f"long_context: h2o evicts down to {room} tokens ({blocks} blocks of {bs} minus one), fewer "
                    f"than sink_tokens + recent_tokens = {kept}; raise device_budget_tokens to at least "
                    f"{(_ceil_div(kept, bs) + 1) * bs}")
            return
        need = _ceil_div(self.sink_tokens, bs) + self.recall_blocks + _ceil_div(self.recent_tokens, bs) + 1
        if self.recall_blocks == 0:
            raise ValueError("long_context.recall_blocks: infinigen needs at least 1")
        if blocks < need:
            raise ValueError(
                f"long_context: infinigen keeps sink ({_ceil_div(self.sink_tokens, bs)}) + recall "
                f"({self.recall_blocks}) + recent ({_ceil_div(self.recent_tokens, bs)}) + 1 blocks of {bs} tokens "
                f"= {need} blocks, but device_budget_tokens={self.device_budget_tokens} allows {blocks}; "
                f"raise it to at least {need * bs}")

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> LongContextConfig:
        """This config with a request's fields replaced: the one check of a request's overrides (names,
        types, ranges; `check` then says whether they fit). Raises ValueError naming the field."""
        if not overrides:
            return self
        unknown = sorted(set(overrides) - set(OVERRIDABLE), key=repr)
        if unknown:
            raise ValueError(f"long_context: unknown field {unknown[0]!r}; use {', '.join(OVERRIDABLE)}")
        return dataclasses.replace(self, **dict(overrides))
