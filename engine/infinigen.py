"""InfiniGen-style offload and recall: cold blocks wait on the host tier; each layer of each step recalls
the blocks its query is likely to attend to.

A sequence's device blocks, once its KV outgrows the budget::

    block_table: [ sink blocks | staging blocks (recall_blocks) | recent blocks ... tail ]
    host tier:   [ offloaded 0, offloaded 1, ... ]  (whole blocks in token order, private slots)

* When the next token would need a block past the budget, the oldest recent blocks move to the host
  tier (through the node's NIXL agent as a loopback WRITE) together with their key summaries (per
  layer and KV head, min and max of the keys, as in Quest), and their device blocks are released.
* Before decode attention at layer ``l``, the summaries of the offloaded blocks are scored against
  the step's query (`kernels.reference.score_blocks`, the max over KV heads); the top ``recall_blocks``
  are copied — layer ``l`` only — into the staging blocks, in token order, skipping those already
  there. Attention then runs over sink + recalled + recent rows. A staging block holds a different
  offloaded block in each layer; keys carry their rotary position, so that is exact.
* With every offloaded block recalled, the rows are the sequence's KV in token order: full attention.

Integrity (`kvstore.digest`, when ``store.integrity`` is on): an offload hashes each victim's layer slices
on device, before the copy (`digest_slices`); each recall hashes a pick (`IntegrityPolicy.pick`) of the
slices that landed in staging blocks and compares. A mismatch is counted (``where="recall"``), the staging
entry is cleared, and the sequence is flagged (`Sequence.kv_corrupt`): the engine discards the token the
step samples for it and recomputes its KV from its tokens (`engine.engine.LLMEngine.step`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from kvrelay.engine.policy_api import PolicyHost, Row
from kvrelay.engine.sequence import Sequence
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.digest import digest_slices

PRIVATE_BLOCK = BlockKey(bytes(32))  # offloaded blocks are private (no key): integrity failures name this one


@dataclass(slots=True, eq=False)
class InfiniGenState:
    """Per sequence (its device blocks stay in ``seq.block_table``)."""

    num_sink_blocks: int
    staging: list[int] = field(default_factory=list)  # device block ids, right after the sink blocks
    host_slots: list[int] = field(default_factory=list)  # offloaded blocks in token order (reserved slots)
    summaries: torch.Tensor | None = None  # [len(host_slots), L, Hkv, 2, D] float32: key min / max
    staged: list[list[int]] = field(default_factory=list)  # [layer][j]: offloaded index in staging j (-1: none)
    slice_digests: list[list[int]] = field(default_factory=list)  # [offloaded index][layer]; empty: integrity off


class InfiniGen:
    wants_weights = False

    def __init__(self, owner: PolicyHost) -> None:
        self.owner = owner
        self._rng = random.Random()  # which recalled slices ``sampled`` integrity checks

    def new_state(self, seq: Sequence) -> InfiniGenState:
        cfg = seq.long_context
        assert cfg is not None
        bs = self.owner.spec.block_size_tokens
        return InfiniGenState(num_sink_blocks=-(-cfg.sink_tokens // bs),
                              staged=[[] for _ in range(self.owner.spec.num_layers)])

    def begin_step(self, seq: Sequence, state: InfiniGenState, *, num_tokens: int) -> None:
        return None

    def observe(self, layer: int, state: InfiniGenState, weights: torch.Tensor, num_rows: int) -> None:
        return None

    def layer_input(self, layer: int, rows: list[Row], x: torch.Tensor,
                    cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        return None

    def on_offload(self, state: InfiniGenState, victims: list[int]) -> None:
        """Before ``victims`` (device blocks, oldest first) are copied to the host: nothing here; the
        speculative mode takes their partial keys."""

    def after_offload(self, state: InfiniGenState) -> None:
        """After an offload added staging blocks: nothing here."""

    # ------------------------------------------------------------------ recall
    def before_decode(self, layer: int, rows: list[Row], q: torch.Tensor) -> None:
        """Pick and recall, for every row with offloaded blocks, this layer's top blocks; check the recalled
        slices (`_check_recall`)."""
        owner = self.owner
        todo = [r for r in rows if r.state.host_slots]
        if not todo:
            return
        scored = [r for r in todo if len(r.state.staging) < len(r.state.host_slots)]
        picks: dict[int, list[int]] = {}
        if scored:
            summaries = torch.cat([r.state.summaries[:, layer] for r in scored])
            counts = [len(r.state.host_slots) for r in scored]
            cand_rows = torch.repeat_interleave(
                torch.tensor([r.row for r in scored], dtype=torch.int64, device=q.device),
                torch.tensor(counts, device=q.device))
            scores = owner.backend.score_blocks(q, summaries, cand_rows, scale=owner.scale).amax(dim=1)
            for r, part in zip(scored, scores.split(counts)):
                picks[r.row] = sorted(part.topk(len(r.state.staging)).indices.tolist())
        src: list[int] = []
        dst: list[int] = []
        landed: list[tuple[Row, int, int]] = []  # per copy: its row, offloaded index and staging index
        for r in todo:
            st = r.state
            chosen = picks.get(r.row, list(range(len(st.host_slots))))
            for j, off in enumerate(chosen):
                if st.staged[layer][j] != off:
                    src.append(st.host_slots[off])
                    dst.append(st.staging[j])
                    landed.append((r, off, j))
                    st.staged[layer][j] = off
        owner.copy_blocks("host", src, "device", dst, layers=[layer] * len(src))
        owner.stats.recalled_layer_blocks += len(src)
        if owner.store.integrity.enabled:
            self._check_recall(layer, dst, landed)

    def _check_recall(self, layer: int, dst: list[int], landed: list[tuple[Row, int, int]]) -> None:
        """Compare a pick of the ``layer`` slices just copied into staging blocks ``dst`` with their digests
        from the offload (one batched hash). A mismatch is counted (``integrity_failure("recall")``), its
        staging entry is cleared (a later recall copies it again), and its sequence is flagged
        (``seq.kv_corrupt``) so that the engine serves nothing computed from it."""
        store = self.owner.store
        picked = store.integrity.pick(len(dst), self._rng)
        if not picked:
            return
        store.integrity_checked("recall", len(picked))
        got = digest_slices(self.owner.kv_pool, [dst[i] for i in picked], [layer] * len(picked))
        for i, digest in zip(picked, got, strict=True):
            r, off, j = landed[i]
            want = r.state.slice_digests[off][layer]
            if digest != want:
                r.state.staged[layer][j] = -1
                r.seq.kv_corrupt = True
                store.integrity_failure(
                    "recall", PRIVATE_BLOCK, f"request {r.seq.request_id} sample {r.seq.index}, host slot "
                    f"{r.state.host_slots[off]}, layer {layer}: digest {digest:016x}, expected {want:016x}")

    def positions(self, seq: Sequence, state: InfiniGenState, layer: int, num_rows: int) -> torch.Tensor:
        bs = self.owner.spec.block_size_tokens
        parts = [torch.arange(state.num_sink_blocks * bs)]
        for off in state.staged[layer]:
            start = (state.num_sink_blocks + off) * bs
            parts.append(torch.arange(start, start + bs))
        first_recent = (state.num_sink_blocks + len(state.host_slots)) * bs
        parts.append(torch.arange(first_recent, first_recent + num_rows - sum(p.numel() for p in parts)))
        pos = torch.cat(parts).to(self.owner.kv_pool.device)
        return pos.expand(self.owner.spec.num_kv_heads, pos.numel())

    # ----------------------------------------------------------------- offload
    def enforce(self, seq: Sequence, state: InfiniGenState) -> None:
        """Offload the oldest recent blocks when the next token would need a block past the budget (with
        integrity on, their layer slices are hashed first, from the device bytes)."""
        cfg = seq.long_context
        assert cfg is not None
        owner = self.owner
        bs = owner.spec.block_size_tokens
        front = state.num_sink_blocks + len(state.staging)
        recent_needed = seq.num_kv_tokens // bs + 1 - front  # recent blocks incl. the next token's
        move = recent_needed - (cfg.budget_blocks(bs) - state.num_sink_blocks - cfg.recall_blocks)
        if move <= 0:
            return
        host = owner.store.host
        assert host is not None, "infinigen needs a host tier (checked when the request was added)"
        slots = host.reserve(move)
        if slots is None:  # host tier full of other offloads: stay over budget, try again next step
            owner.stats.deferred += 1
            return
        victims = seq.block_table[front : front + move]
        summaries = owner.backend.block_key_summaries(
            owner.kv_pool, torch.tensor(victims, dtype=torch.int64, device=owner.kv_pool.device))
        if owner.store.integrity.enabled:
            state.slice_digests.extend(self._slice_digests(victims))
        self.on_offload(state, victims)
        owner.copy_blocks("device", victims, "host", slots)  # falls back to torch; never half done
        state.host_slots.extend(slots)
        owner.tables.replace(seq, front, front + move)  # the victims leave the table (and the pool)
        state.summaries = summaries if state.summaries is None else torch.cat([state.summaries, summaries])
        # Staging blocks come from what the victims freed; shared victims (an n > 1 sibling, a cached
        # prompt) free nothing, so take what is there: fewer staging blocks only mean fewer recalls.
        grow = min(cfg.recall_blocks, len(state.host_slots)) - len(state.staging)
        grow = min(grow, owner.pool.num_free_blocks)
        new = owner.pool.try_allocate(grow) or [] if grow > 0 else []
        state.staging.extend(new)
        for staged in state.staged:
            staged.extend([-1] * len(new))
        owner.tables.replace(seq, front, front, new)  # new staging blocks follow the old ones
        self.after_offload(state)
        seq.num_absent_tokens = (len(state.host_slots) - len(state.staging)) * bs
        seq.keys_stopped = True
        owner.stats.offloaded_blocks += move

    def _slice_digests(self, block_ids: list[int]) -> list[list[int]]:
        """``[i][layer]``: `digest_slices` of device block ``block_ids[i]``, every layer, in one batch."""
        num_layers = self.owner.spec.num_layers
        flat = digest_slices(self.owner.kv_pool, [b for b in block_ids for _ in range(num_layers)],
                             list(range(num_layers)) * len(block_ids))
        return [flat[i : i + num_layers] for i in range(0, len(flat), num_layers)]

    # --------------------------------------------------------------- lifecycle
    def fork(self, state: InfiniGenState) -> InfiniGenState:
        """``n > 1`` samples split at their first token, before any offload (offloads happen after the
        step that samples it), so there is only the empty state to copy."""
        assert not state.host_slots and not state.staging, "forking a sequence with offloaded KV"
        return InfiniGenState(state.num_sink_blocks, staged=[[] for _ in state.staged])

    def free(self, state: InfiniGenState) -> None:
        if state.host_slots:
            assert self.owner.store.host is not None
            self.owner.store.host.unreserve(state.host_slots)
        state.host_slots = []
        state.slice_digests = []
