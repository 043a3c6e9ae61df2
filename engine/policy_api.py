"""What the long-context policies (`engine.h2o`, `engine.infinigen`) and their manager
(`engine.kv_policy.KvPolicies`) share: the policy interface, a step's row of a policy sequence, the
counters, and `PolicyHost`, the part of the manager a policy may use. Policies import this module,
not the manager, so the manager can import the policies without a cycle.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from kvrelay.engine.block_tables import BlockTables
from kvrelay.engine.sequence import Sequence
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.tiered_store import TieredStore
from kvrelay.model.attention import AttentionBackend


@dataclass(slots=True)
class LongContextStats:
    """Counters since start."""

    evicted_tokens: int = 0  # h2o: (token, all layers) rows dropped
    offloaded_blocks: int = 0  # infinigen: device blocks moved to host
    recalled_layer_blocks: int = 0  # infinigen, blocks: (block, layer) slices copied back to device
    recalled_token_rows: int = 0  # infinigen, speculative: (token, layer) rows copied back to device
    deferred: int = 0  # steps a sequence stayed over budget: no free device block (h2o) or host slot (infinigen)
    copy_fallbacks: int = 0  # NIXL loopback copies that failed and were redone with torch


class Policy(Protocol):
    """One policy's behaviour; its per-sequence state is opaque to the manager."""

    wants_weights: bool  # attention must output per-token weights for this policy's sequences

    def new_state(self, seq: Sequence) -> Any: ...

    def begin_step(self, seq: Sequence, state: Any, *, num_tokens: int) -> None:
        """Before the forward: ``num_tokens`` new tokens of ``seq`` get KV rows this step."""

    def layer_input(self, layer: int, rows: list[Row], x: torch.Tensor,
                    cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Per layer, at its start: ``x`` ``[Nd, hidden]`` is the layer's input (residual stream) of the step's
        decode rows, ``cos_sin`` their rotary tables ``[Nd, D]``."""

    def before_decode(self, layer: int, rows: list[Row], q: torch.Tensor) -> None:
        """Per layer, before decode attention; ``q`` ``[Nd, Hq, D]`` is the step's decode queries. Sets
        ``row.seq.kv_corrupt`` when KV the row will attend to failed an integrity check."""

    def observe(self, layer: int, state: Any, weights: torch.Tensor, num_rows: int) -> None:
        """Per layer, after attention: ``weights`` ``[Hkv, W]`` of the sequence's first ``num_rows`` rows."""

    def positions(self, seq: Sequence, state: Any, layer: int, num_rows: int) -> torch.Tensor:
        """``[Hkv, num_rows]`` token positions attended at ``layer``."""
        ...

    def enforce(self, seq: Sequence, state: Any) -> None:
        """After the step: bring ``seq`` within its device budget for the next token."""

    def fork(self, state: Any) -> Any: ...

    def free(self, state: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class Row:
    """One policy sequence in a step: its row in the step's decode (or prefill) batch, and how many
    KV rows it attends over after this step's tokens are written."""

    row: int
    seq: Sequence
    policy: Policy
    state: Any
    num_rows: int


class PolicyHost(Protocol):
    """The manager's members a policy uses (`engine.kv_policy.KvPolicies` provides them)."""

    store: TieredStore
    pool: BlockPool
    tables: BlockTables  # every block-table edit goes through it
    kv_pool: torch.Tensor  # [num_blocks, L, 2, Hkv, B, D], the device tier (policies refuse one-plane MLA pools)
    backend: AttentionBackend
    spec: BlockSpec
    scale: float
    stats: LongContextStats

    def copy_blocks(self, src_tier: str, src_ids: Seq[int], dst_tier: str, dst_ids: Seq[int], *,
                    layers: Seq[int] | None = None) -> None: ...

    def copy_rows(self, src_tier: str, src_ids: Seq[int], src_rows: Seq[int], dst_tier: str, dst_ids: Seq[int],
                  dst_rows: Seq[int], *, layer: int) -> None: ...
