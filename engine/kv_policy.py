"""`KvPolicies`: the long-context policies of one engine — per-sequence state, the calls inside each
model step, and the budget enforced after it (docs/design.md §7, `engine.long_context` for the knobs).

One step, for the sequences of the step whose policy is ``h2o`` or ``infinigen``::

    engine.step
      ├─ hook = policies.step_hook(scheduled)        state made; H2O: rows written this step recorded
      ├─ model forward, per layer (model.attention.paged_attention):
      │     hook.before_decode(layer, q)             InfiniGen: score offloaded blocks, recall top-k, check
      │                                              their digests (a mismatch flags ``seq.kv_corrupt``)
      │     attention (H2O: with per-token weights)
      │     hook.after_attention(layer)              H2O: accumulate the weights
      ├─ flagged sequences sample nothing and are preempted for recompute (`LLMEngine._drop_corrupt`)
      └─ policies.after_step(scheduled)              over budget → H2O evicts / InfiniGen offloads

State is dropped (host slots given back) when the scheduler frees a sequence's blocks (`on_free`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch
from kvrelay.engine.block_tables import BlockTables
from kvrelay.engine.h2o import H2O
from kvrelay.engine.infinigen import InfiniGen
from kvrelay.engine.infinigen_speculative import SpeculativeInfiniGen
from kvrelay.engine.policy_api import LongContextStats, Policy, Row
from kvrelay.engine.scheduler import ScheduledStep
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.tiered_store import TieredStore
from kvrelay.model.attention import AttentionBackend

log = logging.getLogger(__name__)

# ``observer(seq, layer, positions)``: after attention, the token positions each KV head of ``seq``
# attended over (``[Hkv, n]`` int64) — what the benchmark needs to measure the attention mass kept.
Observer = Callable[[Sequence, int, torch.Tensor], None]


class KvPolicies:
    """Owned by the engine (its thread); see the module docstring.

    Args:
        store: the engine's tiered store (device pool, block pool, host tier, local copy path).
        backend: attention kernels (block summaries and scores come from it).
        tables: the engine's one writer of block tables; policies edit tables only through it.
        spec: block layout.
        scale: the model's softmax scale (``head_dim ** -0.5``).
    """

    def __init__(self, store: TieredStore, backend: AttentionBackend, *, tables: BlockTables, spec: BlockSpec,
                 scale: float) -> None:
        self.store = store
        self.pool = store.block_pool
        self.tables = tables
        self.kv_pool = store.device_pool
        self.backend = backend
        self.spec = spec
        self.scale = scale
        self.stats = LongContextStats()
        self.observer: Observer | None = None
        self.speculative = SpeculativeInfiniGen(self)  # the engine gives it the model's skew tables
        self.name_to_policy: dict[str, Policy] = {"h2o": H2O(self), "infinigen": InfiniGen(self),
                                                  "infinigen-speculative": self.speculative}
        self._states: dict[int, tuple[Policy, Any]] = {}  # seq_id → (policy, state); owned here

    # ------------------------------------------------------------------ queries
    def state_of(self, seq: Sequence) -> Any:
        """The policy state of ``seq`` (None if it has none yet): for tests and benchmarks."""
        entry = self._states.get(seq.seq_id)
        return None if entry is None else entry[1]

    def _entry(self, seq: Sequence) -> tuple[Policy, Any]:
        entry = self._states.get(seq.seq_id)
        if entry is None:
            cfg = seq.long_context
            assert cfg is not None
            policy = self.name_to_policy["infinigen-speculative" if cfg.speculative else cfg.policy]
            entry = (policy, policy.new_state(seq))
            self._states[seq.seq_id] = entry
        return entry

    # ------------------------------------------------------------- step calls
    def step_hook(self, step: ScheduledStep) -> StepHook | None:
        """The calls for this step's forward, or None when no sequence in it has a policy."""
        decodes = [Row(i, s, *self._entry(s), s.num_kv_tokens + 1)
                   for i, s in enumerate(step.decodes) if s.long_context is not None]
        prefills = [Row(i, c.seq, *self._entry(c.seq), c.seq.num_computed_tokens + c.num_tokens)
                    for i, c in enumerate(step.prefills) if c.seq.long_context is not None]
        if not decodes and not prefills:
            return None
        for r in decodes:
            r.policy.begin_step(r.seq, r.state, num_tokens=1)
        for r in prefills:
            r.policy.begin_step(r.seq, r.state, num_tokens=r.num_rows - r.seq.num_computed_tokens)
        decode_width = max((s.num_kv_tokens + 1 for s in step.decodes), default=0)
        prefill_width = max((c.seq.num_computed_tokens + c.num_tokens for c in step.prefills), default=0)
        return StepHook(self, decodes, prefills, decode_shape=(len(step.decodes), decode_width),
                        prefill_shape=(len(step.prefills), prefill_width))

    def after_step(self, running: Seq[Sequence]) -> None:
        """Enforce the budget of every running policy sequence that decodes next (those of this step and
        the ``n > 1`` samples forked in it). Never raises for lack of room: see `LongContextStats.deferred`."""
        for seq in running:
            if seq.long_context is not None and seq.status is SequenceStatus.RUNNING and seq.is_decode:
                policy, state = self._entry(seq)
                policy.enforce(seq, state)

    # --------------------------------------------------------------- lifecycle
    def on_free(self, seq: Sequence) -> None:
        """The scheduler is releasing ``seq``'s blocks: drop its state (host slots given back)."""
        entry = self._states.pop(seq.seq_id, None)
        if entry is not None:
            entry[0].free(entry[1])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` starts as a copy of ``parent`` (an ``n > 1`` sample): copy the state too."""
        entry = self._states.get(parent.seq_id)
        if entry is not None:
            self._states[child.seq_id] = (entry[0], entry[0].fork(entry[1]))

    def check_integrity(self, live: Seq[Sequence]) -> None:
        """Assert states belong to live sequences and host reservations match the states' slots."""
        ids = {s.seq_id for s in live}
        assert set(self._states) <= ids, f"policy state for finished sequences {sorted(set(self._states) - ids)}"
        held = sum(len(getattr(st, "host_slots", ())) for _, st in self._states.values())
        reserved = self.store.host.num_reserved if self.store.host is not None else 0
        assert held == reserved, f"host tier reserves {reserved} slots, policy states hold {held}"

    def close(self) -> None:
        """Stop the prefetch thread (waits for a copy in flight)."""
        self.speculative.close()

    # ------------------------------------------------------------------ copies
    def _local_copy(self, src_tier: str, src_ids: Seq[int], dst_tier: str, dst_ids: Seq[int], **kwargs: Any) -> bool:
        """Copy through the node's NIXL agent when one is attached; False when there is none or it failed (the
        destination's bytes are then unknown: the caller copies them again with torch)."""
        if self.store.local_copy is None:
            return False
        try:
            self.store.local_copy(src_tier, src_ids, dst_tier, dst_ids, **kwargs)
            return True
        except Exception:  # noqa: BLE001 - any failure: the caller's torch copy redoes it
            log.exception("loopback copy %s -> %s failed; copying with torch", src_tier, dst_tier)
            self.stats.copy_fallbacks += 1
            return False

    def copy_rows(self, src_tier: str, src_ids: Seq[int], src_rows: Seq[int], dst_tier: str, dst_ids: Seq[int],
                  dst_rows: Seq[int], *, layer: int) -> None:
        """Copy token rows — row ``src_rows[i]`` of block ``src_ids[i]`` to row ``dst_rows[i]`` of ``dst_ids[i]``,
        layer ``layer`` only — between ``device`` and ``host``: through the node's NIXL agent when one is
        attached, else with torch (one gather, one scatter)."""
        if not src_ids or self._local_copy(src_tier, src_ids, dst_tier, dst_ids, layers=[layer] * len(src_ids),
                                           rows=(src_rows, dst_rows)):
            return
        assert self.store.host is not None
        pools = {"device": self.kv_pool, "host": self.store.host.pool}
        src, dst = pools[src_tier][:, layer], pools[dst_tier][:, layer]  # [N, 2, Hkv, B, D]

        def index(values: Seq[int], like: torch.Tensor) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=like.device)

        rows = src[index(src_ids, src), :, :, index(src_rows, src)]  # [n, 2, Hkv, D]
        dst[index(dst_ids, dst), :, :, index(dst_rows, dst)] = rows.to(dst.device, non_blocking=True)

    # ------------------------------------------------------------------ block copies
    def copy_blocks(self, src_tier: str, src_ids: Seq[int], dst_tier: str, dst_ids: Seq[int], *,
                    layers: Seq[int] | None = None) -> None:
        """Move whole blocks, or one layer each, between ``device`` and ``host``: through the node's NIXL
        agent when one is attached (`TieredStore.attach_local_copy`), else with torch."""
        if not src_ids or self._local_copy(src_tier, src_ids, dst_tier, dst_ids, layers=layers):
            return
        assert self.store.host is not None
        pools = {"device": self.kv_pool, "host": self.store.host.pool}
        src, dst = pools[src_tier], pools[dst_tier]
        for i, (s, d) in enumerate(zip(src_ids, dst_ids, strict=True)):
            if layers is None:
                dst[d].copy_(src[s])
            else:
                dst[d, layers[i]].copy_(src[s, layers[i]])


class StepHook:
    """`model.attention.KvHook` for one step: routes each layer's calls to the sequences' policies.

    Weight buffers ``[rows, Hkv, width]`` cover every row of the step (the kernels fill all rows);
    only policy rows are read.
    """

    def __init__(self, owner: KvPolicies, decodes: list[Row], prefills: list[Row], *,
                 decode_shape: tuple[int, int], prefill_shape: tuple[int, int]) -> None:
        self.owner = owner
        self.decodes = decodes
        self.prefills = prefills
        heads, device = owner.spec.num_kv_heads, owner.kv_pool.device

        def buffer(rows: list[Row], shape: tuple[int, int]) -> torch.Tensor | None:
            if not any(r.policy.wants_weights for r in rows):
                return None
            return torch.zeros(shape[0], heads, shape[1], dtype=torch.float32, device=device)

        self._decode_weights = buffer(decodes, decode_shape)
        self._prefill_weights = buffer(prefills, prefill_shape)
        self._by_policy: dict[int, tuple[Policy, list[Row]]] = {}
        for r in decodes:
            self._by_policy.setdefault(id(r.policy), (r.policy, []))[1].append(r)

    def token_weights(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._prefill_weights, self._decode_weights

    def layer_input(self, layer: int, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        for policy, rows in self._by_policy.values():
            policy.layer_input(layer, rows, x, cos_sin)

    def before_decode(self, layer: int, q: torch.Tensor, layer_cache: torch.Tensor) -> None:
        for policy, rows in self._by_policy.values():
            policy.before_decode(layer, rows, q)

    def after_attention(self, layer: int) -> None:
        observer = self.owner.observer
        for weights, rows in ((self._prefill_weights, self.prefills), (self._decode_weights, self.decodes)):
            for r in rows:
                if weights is not None and r.policy.wants_weights:
                    r.policy.observe(layer, r.state, weights[r.row], r.num_rows)
        if observer is not None:
            for r in self.decodes:
                observer(r.seq, layer, r.policy.positions(r.seq, r.state, layer, r.num_rows))
