"""H2O (heavy-hitter oracle): permanent eviction of the least-attended KV rows, per layer and KV head.

Every KV row of a sequence accumulates the attention weight it receives (summed over the query heads
of its KV group), in prefill and in every decode step. When the next token would need a block past
the budget, each (layer, KV head) keeps its sink rows, its recent rows and its highest-scoring rows
in between, and the sequence's KV is compacted into its first blocks::

    before   rows: [ sink | s s s s s s s s s s s s | recent ]        n rows
    keep           [ sink | top (budget-1 blocks)   | recent ]        (budget_blocks - 1) · B rows
    after    blocks past the kept rows are released; one block of room is left for the next tokens

Keys already carry their rotary position, so which row holds a token does not change attention:
each (layer, head) may keep different tokens in the same rows. Blocks that change and are shared
(keyed in the prefix cache, or referenced by an ``n > 1`` sibling) are replaced by private copies
first, so a shared block is never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvrelay.engine.policy_api import PolicyHost, Row
from kvrelay.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class H2OState:
    """Per sequence. ``scores`` and ``positions`` are ``[L, Hkv, capacity]`` on the pool's device;
    rows past the sequence's KV length are garbage."""

    scores: torch.Tensor  # float32: accumulated attention weight of each KV row
    positions: torch.Tensor  # int64: the token position whose KV each row holds


class H2O:
    wants_weights = True

    def __init__(self, owner: PolicyHost) -> None:
        self.owner = owner

    def new_state(self, seq: Sequence) -> H2OState:
        spec, device = self.owner.spec, self.owner.kv_pool.device
        cap = max(64, seq.num_kv_tokens + 64)
        shape = (spec.num_layers, spec.num_kv_heads, cap)
        positions = torch.arange(cap, device=device).expand(shape).clone()
        return H2OState(torch.zeros(shape, dtype=torch.float32, device=device), positions)

    def begin_step(self, seq: Sequence, state: H2OState, *, num_tokens: int) -> None:
        start_row, start_pos = seq.num_kv_tokens, seq.num_computed_tokens
        end = start_row + num_tokens
        cap = state.scores.shape[2]
        if end > cap:
            grow = max(end - cap, cap)
            state.scores = torch.cat([state.scores, state.scores.new_zeros(*state.scores.shape[:2], grow)], dim=2)
            state.positions = torch.cat([state.positions, state.positions.new_zeros(*state.positions.shape[:2], grow)],
                                        dim=2)
        state.scores[:, :, start_row:end] = 0
        state.positions[:, :, start_row:end] = torch.arange(start_pos, start_pos + num_tokens,
                                                            device=state.positions.device)

    def layer_input(self, layer: int, rows: list[Row], x: torch.Tensor,
                    cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        return None

    def before_decode(self, layer: int, rows: list[Row], q: torch.Tensor) -> None:
        return None

    def observe(self, layer: int, state: H2OState, weights: torch.Tensor, num_rows: int) -> None:
        state.scores[layer, :, :num_rows] += weights[:, :num_rows]

    def positions(self, seq: Sequence, state: H2OState, layer: int, num_rows: int) -> torch.Tensor:
        return state.positions[layer, :, :num_rows]

    def fork(self, state: H2OState) -> H2OState:
        return H2OState(state.scores.clone(), state.positions.clone())

    def free(self, state: H2OState) -> None:
        return None

    def enforce(self, seq: Sequence, state: H2OState) -> None:
        """Evict down to ``budget_blocks - 1`` blocks when the next token would not fit the budget."""
        cfg = seq.long_context
        assert cfg is not None
        owner = self.owner
        bs = owner.spec.block_size_tokens
        budget = cfg.budget_blocks(bs)
        n = seq.num_kv_tokens
        if n // bs + 1 <= budget:
            return
        keep = (budget - 1) * bs
        sink, recent = cfg.sink_tokens, cfg.recent_tokens
        heavy = keep - sink - recent
        num_layers, heads = state.scores.shape[:2]
        device = state.scores.device
        middle = state.scores[:, :, sink : n - recent]
        top = middle.topk(heavy, dim=2).indices + sink if heavy > 0 else middle.new_zeros(
            num_layers, heads, 0, dtype=torch.int64)
        idx = torch.cat([
            torch.arange(sink, device=device).expand(num_layers, heads, sink),
            top,
            torch.arange(n - recent, n, device=device).expand(num_layers, heads, recent),
        ], dim=2).sort(dim=2).values  # [L, H, keep], ascending: kept rows keep their order
        if not self._compact(seq, idx, n):
            owner.stats.deferred += 1  # no block for a copy-on-write: stay over budget, try next step
            return
        state.scores = torch.cat([state.scores.gather(2, idx), state.scores.new_zeros(num_layers, heads, bs)], dim=2)
        state.positions = torch.cat([state.positions.gather(2, idx),
                                     state.positions.new_zeros(num_layers, heads, bs)], dim=2)
        seq.num_absent_tokens += n - keep
        seq.keys_stopped = True
        owner.stats.evicted_tokens += n - keep

    def _compact(self, seq: Sequence, idx: torch.Tensor, n: int) -> bool:
        """Rewrite ``seq``'s KV so that row ``i`` of (layer, head) holds old row ``idx[layer, head, i]``.

        Returns False, changing nothing, when the pool lacks the blocks for copies of shared blocks.
        """
        owner = self.owner
        pool, kv = owner.pool, owner.kv_pool
        bs = owner.spec.block_size_tokens
        num_layers, heads, keep = idx.shape
        nb_old = -(-n // bs)
        nb_new = -(-keep // bs)
        moved = (idx != torch.arange(keep, device=idx.device)).nonzero()
        first_block = int(moved[:, 2].min()) // bs if moved.numel() else nb_new
        shared = [i for i in range(first_block, nb_new)
                  if pool.ref_count(seq.block_table[i]) > 1 or pool.key_of(seq.block_table[i]) is not None]
        freed = sum(pool.ref_count(b) == 1 for b in seq.block_table[nb_new:nb_old])
        if len(shared) > pool.num_free_blocks + freed:
            return False
        table = torch.tensor(seq.block_table[:nb_old], dtype=torch.int64, device=kv.device)
        # [nb, L, P, H, B, D] → [L, P, H, nb·B, D]: the sequence's rows in order (P planes: K and V)
        planes = kv.shape[2]
        rows = kv[table].permute(1, 2, 3, 0, 4, 5).reshape(num_layers, planes, heads, nb_old * bs, -1)
        d = rows.shape[-1]
        kept = rows.gather(3, idx[:, None, :, :, None].expand(num_layers, planes, heads, keep, d))
        tables = owner.tables
        tables.replace(seq, nb_new, len(seq.block_table))
        fresh = pool.allocate(len(shared))  # cannot fail: counted above
        for i, b in zip(shared, fresh):  # shared: write a private copy instead
            tables.replace(seq, i, i + 1, [b])
        if first_block >= nb_new:
            return True
        padded = kept.new_zeros(num_layers, planes, heads, nb_new * bs, d)
        padded[:, :, :, :keep] = kept
        blocks = padded.reshape(num_layers, planes, heads, nb_new, bs, d).permute(3, 0, 1, 2, 4, 5)
        dst = torch.tensor(seq.block_table[first_block:nb_new], dtype=torch.int64, device=kv.device)
        kv[dst] = blocks[first_block:].to(kv.dtype)
        return True
