"""InfiniGen as the paper does it (``selection: speculative``): while layer ``i`` runs, speculate which tokens
layer ``i+1`` will attend to, from a partial query and a partial key cache, and prefetch those tokens' KV.

Offload is `engine.infinigen.InfiniGen`'s (whole cold blocks to the host tier, private slots); what differs is
what comes back and when::

    offload:   victims' keys → partial keys (`model.skew.partial_keys`: R skewed channels per KV head) kept on
               the device for every offloaded token, ``[L, T_off, Hkv, R]`` float32
    layer i:   x_i (its input) → q̃ = partial_query(speculation_query(layer i+1, x_i))      (main thread)
               scores[t] = max over query heads of q̃·k̃_t / sqrt(D)                        (prefetch thread)
               fetch: tokens with scores >= max - alpha, at most C (the staging rows)
               rows:  fetched ∪ tokens staged for layer i+1 last step (by score) ∪ the next best, C in all
               copy:  host → staging rows of layer i+1, in token order (over NIXL when the node's agent is
                      attached); rows already staged move on the device; nothing else is read
    layer i+1: waits for its prefetch, then attends over sink + staged rows + recent rows

``C = recall_blocks * B`` (the staging blocks' rows) caps what layer ``i+1`` sees of the offloaded tokens;
the margin ``alpha`` (``speculation_alpha``) decides what must be fetched this step — tokens already staged
stay without a copy, so a stable pattern moves little (what a layer attends to then depends on what it
staged before, not only on this step's query). Layers before `first_speculated_layer` (layers 0 and 1, or
layer 0 of a 2-layer model) select with their own exact query, synchronously, before their attention
(InfiniGen runs its first two layers dense: there a layer's input predicts the next layer poorly). The copy
of layer ``i+1`` runs on a prefetch thread (on CUDA, on a side stream ordered by events) while the main
thread computes layer ``i``'s attention and MLP.

Integrity (when ``store.integrity`` is on): each copy hashes a pick of the host slices its tokens were read
from and compares them with the digests taken at offload; a mismatch flags the sequence (`Sequence.kv_corrupt`)
as the block mode does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.infinigen import PRIVATE_BLOCK, InfiniGen, InfiniGenState
from engine.policy_api import PolicyHost, Row
from engine.sequence import Sequence
from kvstore.digest import digest_slices
from model.llama import LlamaForCausalLM
from model.skew import SkewTables, partial_keys, partial_query, speculation_query

SPECULATE_FROM = 2  # layers before it select with their own query (InfiniGen keeps layers 0 and 1 dense)


def first_speculated_layer(num_layers: int) -> int:
    """`SPECULATE_FROM`, lowered for a model too shallow to have speculated layers past it (a 2-layer model
    speculates its layer 1): every layer but the first may be speculated."""
    return min(SPECULATE_FROM, max(1, num_layers - 1))
_RANK_STEP = 1e9  # larger than any score range: ranks fetched tokens, then staged ones, then the rest


@dataclass(frozen=True, slots=True)
class Speculation:
    """What speculation needs from the model: its weights (for the next layer's query) and its skew tables
    on the KV pool's device."""

    model: LlamaForCausalLM
    tables: SkewTables


@dataclass(slots=True, eq=False)
class SpeculativeState(InfiniGenState):
    """`InfiniGenState` plus the partial key cache and the tokens held by each layer's staging rows."""

    partial_keys: torch.Tensor | None = None  # [L, T_off, Hkv, R] float32, offloaded tokens in order
    staged_tokens: list[torch.Tensor] = field(default_factory=list)  # [layer]: [C] int64 token per row, -1: none


class SpeculativeInfiniGen(InfiniGen):
    """``policy: infinigen, selection: speculative`` (see the module doc). One instance per engine; its
    prefetch thread is the only other thread that touches a sequence's staging rows, one layer at a time."""

    def __init__(self, owner: PolicyHost) -> None:
        super().__init__(owner)
        self.speculation: Speculation | None = None  # set by the engine before the first such sequence
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[int, tuple[Future[int], torch.cuda.Event | None]] = {}  # layer → its prefetch
        self._side: torch.cuda.Stream | None = None
        self._rng = random.Random()
        self.first_speculated = first_speculated_layer(owner.spec.num_layers)

    def new_state(self, seq: Sequence) -> SpeculativeState:
        base = super().new_state(seq)
        return SpeculativeState(base.num_sink_blocks, staged=base.staged)

    def fork(self, state: InfiniGenState) -> SpeculativeState:
        base = super().fork(state)
        return SpeculativeState(base.num_sink_blocks, staged=base.staged)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------ offload side
    def on_offload(self, state: InfiniGenState, victims: list[int]) -> None:
        """Before the victims leave the device: append their partial keys (every layer) to the cache, and
        widen each layer's staging map for the staging blocks `InfiniGen.enforce` may add."""
        assert isinstance(state, SpeculativeState) and self.speculation is not None
        pool = self.owner.kv_pool
        ids = torch.tensor(victims, dtype=torch.int64, device=pool.device)
        keys = pool.index_select(0, ids)[:, :, 0]  # [m, L, Hkv, B, D]
        m, num_layers, heads, bs, dim = keys.shape
        rows = keys.permute(1, 0, 3, 2, 4).reshape(num_layers, m * bs, heads, dim)  # tokens in order
        new = torch.stack([partial_keys(self.speculation.tables, layer, rows[layer]) for layer in range(num_layers)])
        state.partial_keys = new if state.partial_keys is None else torch.cat([state.partial_keys, new], dim=1)

    def after_offload(self, state: InfiniGenState) -> None:
        assert isinstance(state, SpeculativeState)
        rows = len(state.staging) * self.owner.spec.block_size_tokens
        device = self.owner.kv_pool.device
        if not state.staged_tokens:
            state.staged_tokens = [torch.full((0,), -1, dtype=torch.int64, device=device)
                                   for _ in range(self.owner.spec.num_layers)]
        for layer, held in enumerate(state.staged_tokens):
            if held.numel() < rows:
                pad = torch.full((rows - held.numel(),), -1, dtype=torch.int64, device=device)
                state.staged_tokens[layer] = torch.cat([held, pad])

    # ------------------------------------------------------------- step side
    def layer_input(self, layer: int, rows: list[Row], x: torch.Tensor,
                    cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Layer ``layer``'s input ``x`` ``[Nd, hidden]`` (the step's decode rows): speculate layer
        ``layer + 1``'s tokens for every row with offloaded KV and start their prefetch."""
        nxt = layer + 1
        todo = [r for r in rows if r.state.host_slots]
        if not todo or nxt >= self.owner.spec.num_layers or nxt < self.first_speculated:
            return
        assert self.speculation is not None
        idx = torch.tensor([r.row for r in todo], dtype=torch.int64, device=x.device)
        cos, sin = cos_sin
        q = speculation_query(self.speculation.model, nxt, x.index_select(0, idx),
                              (cos.index_select(0, idx), sin.index_select(0, idx)))
        q_part = partial_query(self.speculation.tables, nxt, q)  # [n, Hq, R]
        self._pending[nxt] = self._submit(lambda: self._recall(nxt, todo, q_part))

    def before_decode(self, layer: int, rows: list[Row], q: torch.Tensor) -> None:
        """Layers before ``first_speculated`` (or a layer whose prefetch was not started): select with the
        layer's own query and copy now. Others: wait for the prefetch started at the previous layer."""
        pending = self._pending.pop(layer, None)
        if pending is not None:
            future, done = pending
            self.owner.stats.recalled_token_rows += future.result()
            if done is not None:
                torch.cuda.current_stream(self.owner.kv_pool.device).wait_event(done)
            return
        todo = [r for r in rows if r.state.host_slots]
        if not todo:
            return
        assert self.speculation is not None
        idx = torch.tensor([r.row for r in todo], dtype=torch.int64, device=q.device)
        q_part = partial_query(self.speculation.tables, layer, q.index_select(0, idx))
        self.owner.stats.recalled_token_rows += self._recall(layer, todo, q_part)

    def _submit(self, job: Callable[[], int]) -> tuple[Future[int], torch.cuda.Event | None]:
        """Run ``job`` on the prefetch thread (on CUDA: on a side stream after the main stream's work so far;
        the returned event marks its copies done)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvrelay-prefetch")
        device = self.owner.kv_pool.device
        if device.type != "cuda":
            return self._executor.submit(job), None
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        ready, done, side = torch.cuda.Event(), torch.cuda.Event(), self._side
        ready.record(torch.cuda.current_stream(device))

        def on_side() -> int:
            with torch.cuda.stream(side):
                side.wait_event(ready)
                fetched = job()
                done.record(side)
            return fetched

        return self._executor.submit(on_side), done

    @torch.inference_mode()
    def _recall(self, layer: int, rows: list[Row], q_part: torch.Tensor) -> int:
        """Select and copy layer ``layer``'s staging rows for ``rows`` (``q_part`` ``[len(rows), Hq, R]``);
        returns the rows read from the host."""
        return sum(self._recall_one(layer, r, qp) for r, qp in zip(rows, q_part, strict=True))

    def _recall_one(self, layer: int, r: Row, q_part: torch.Tensor) -> int:
        st: SpeculativeState = r.state
        owner = self.owner
        bs = owner.spec.block_size_tokens
        capacity = len(st.staging) * bs
        if capacity == 0:
            return 0
        cfg = r.seq.long_context
        assert cfg is not None and st.partial_keys is not None
        keys = st.partial_keys[layer]  # [T, Hkv, R]
        group = q_part.shape[0] // keys.shape[1]
        scores = torch.einsum("hr,thr->ht", q_part, keys.repeat_interleave(group, dim=1)) * owner.scale
        score = scores.amax(dim=0)  # [T]: the best head's logit for each offloaded token
        held = st.staged_tokens[layer]
        fetch = score >= score.max() - cfg.speculation_alpha
        staged = torch.zeros_like(fetch)
        staged[held[held >= 0]] = True
        rank = score + _RANK_STEP * (2 * fetch.to(score.dtype) + staged.to(score.dtype))
        chosen = rank.topk(capacity).indices.sort().values  # the C rows, in token order
        # Where each chosen token is now: its staging row, or -1 (on the host only).
        where = torch.full_like(score, -1, dtype=torch.int64)
        live = held >= 0
        where[held[live]] = torch.arange(held.numel(), device=held.device)[live]
        src = where[chosen]
        target = torch.arange(capacity, device=chosen.device)
        move = (src >= 0) & (src != target)
        fetched = src < 0
        self._copy_rows(layer, st, src[move], target[move], chosen[fetched], target[fetched], r.seq)
        st.staged_tokens[layer] = chosen
        return int(fetched.sum())

    def _copy_rows(self, layer: int, st: SpeculativeState, move_from: torch.Tensor, move_to: torch.Tensor,
                   tokens: torch.Tensor, fetch_to: torch.Tensor, seq: Sequence) -> None:
        """Staging rows ``move_from`` → ``move_to`` on the device (read all first: the sets overlap), then
        offloaded ``tokens`` from the host into staging rows ``fetch_to``; layer ``layer`` only."""
        owner = self.owner
        bs = owner.spec.block_size_tokens
        device = owner.kv_pool.device
        staging = torch.tensor(st.staging, dtype=torch.int64, device=device)
        layer_pool = owner.kv_pool[:, layer]  # [N, 2, Hkv, B, D]
        if move_from.numel():
            moved = layer_pool[staging[move_from // bs], :, :, move_from % bs]  # [m, 2, Hkv, D], a copy
            layer_pool[staging[move_to // bs], :, :, move_to % bs] = moved
        if not tokens.numel():
            return
        tokens_cpu, to_cpu = tokens.tolist(), fetch_to.tolist()
        src_slots = [st.host_slots[t // bs] for t in tokens_cpu]
        owner.copy_rows("host", src_slots, [t % bs for t in tokens_cpu], "device",
                        [st.staging[j // bs] for j in to_cpu], [j % bs for j in to_cpu], layer=layer)
        if owner.store.integrity.enabled and st.slice_digests:
            self._check_sources(layer, st, sorted({t // bs for t in tokens_cpu}), seq)

    def _check_sources(self, layer: int, st: SpeculativeState, offloaded: list[int], seq: Sequence) -> None:
        """Hash a pick of the host slices (offloaded block ``offloaded[i]``, ``layer``) rows were read from and
        compare with their digests from the offload; a mismatch flags ``seq`` (see the module doc)."""
        store = self.owner.store
        assert store.host is not None
        picked = store.integrity.pick(len(offloaded), self._rng)
        if not picked:
            return
        store.integrity_checked("recall", len(picked))
        slots = [st.host_slots[offloaded[i]] for i in picked]
        got = digest_slices(store.host.pool, slots, [layer] * len(picked))
        for i, slot, digest in zip(picked, slots, got, strict=True):
            want = st.slice_digests[offloaded[i]][layer]
            if digest != want:
                seq.kv_corrupt = True
                store.integrity_failure(
                    "recall", PRIVATE_BLOCK, f"request {seq.request_id} sample {seq.index}, host slot {slot}, "
                    f"layer {layer}: digest {digest:016x}, expected {want:016x}")

    def end_step(self) -> None:
        """Wait for prefetches nobody waited for (a step that raised midway), so no copy outlives its step."""
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            self.owner.stats.recalled_token_rows += future.result()

    def positions(self, seq: Sequence, state: InfiniGenState, layer: int, num_rows: int) -> torch.Tensor:
        assert isinstance(state, SpeculativeState)
        if not state.host_slots:
            return super().positions(seq, state, layer, num_rows)
        bs = self.owner.spec.block_size_tokens
        device = self.owner.kv_pool.device
        sink = torch.arange(state.num_sink_blocks * bs, device=device)
        staged = state.staged_tokens[layer]
        staged = staged[staged >= 0] + state.num_sink_blocks * bs
        first_recent = (state.num_sink_blocks + len(state.host_slots)) * bs
        recent = torch.arange(first_recent, first_recent + num_rows - sink.numel() - len(state.staging) * bs,
                              device=device)
        pos = torch.cat([sink, staged.to(device), recent])
        return pos.expand(self.owner.spec.num_kv_heads, pos.numel())
