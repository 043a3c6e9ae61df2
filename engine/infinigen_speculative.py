"""InfiniGen as the paper does it (``selection: speculative``): while layer ``i`` runs, speculate which tokens
layer ``i+1`` will attend to, from a partial query and a partial key cache, and prefetch those tokens' KV.

Offload is `engine.infinigen.InfiniGen`'s (whole cold blocks to the host tier, private slots); what differs is
what comes back and when::

    offload:   victims' keys → partial keys (`model.skew.partial_keys`: R skewed channels per KV head) kept on
               the device for every offloaded token, ``[L, T_off, Hkv, R]`` in the KV dtype
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
staged before, not only on this step's query). Layers 0 and 1 (`SPECULATE_FROM`) select with their own exact
query, synchronously, before their attention: InfiniGen keeps its first two layers out of speculation, as a
layer's input predicts the next layer poorly there (so a 2-layer model speculates nothing). The copy
of layer ``i+1`` runs on a prefetch thread (on CUDA, on a side stream ordered by events) while the main
thread computes layer ``i``'s attention and MLP.

Integrity (when ``store.integrity`` is on): each copy hashes a pick of the host slices its tokens were read
from and compares them with the digests taken at offload; a mismatch flags the sequence (`Sequence.kv_corrupt`)
as the block mode does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from kvrelay.engine.infinigen import PRIVATE_BLOCK, InfiniGen, InfiniGenState
from kvrelay.engine.policy_api import PolicyHost, Row
from kvrelay.engine.sequence import Sequence
from kvrelay.kvstore.digest import digest_slices
from kvrelay.model.llama import LlamaForCausalLM
from kvrelay.model.skew import SkewTables, partial_keys, partial_query, speculation_query
from torch.nn.utils.rnn import pad_sequence

log = logging.getLogger(__name__)
SPECULATE_FROM = 2  # layers before it select with their own query (InfiniGen keeps layers 0 and 1 dense)
_RANK_STEP = 1e9  # larger than any score range: ranks fetched tokens, then staged ones, then the rest


def select_rows(score: torch.Tensor, held: torch.Tensor, caps: torch.Tensor,
                alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which offloaded tokens each row's staging rows hold next, and where each is now.

    Row ``i`` has ``T_i`` offloaded tokens and ``C_i = caps[i] <= T_i`` staging rows. Its ``C_i`` tokens are,
    in this order of preference, those whose score is within ``alpha[i]`` of its best (highest first), those
    its staging rows hold now (highest first), then the rest (highest first); they are returned in token order.

    Args:
        score: ``[n, Tmax]`` float, each token's speculated logit; ``-inf`` past ``T_i``.
        held: ``[n, Cmax]`` int64, the token each staging row holds now, ``-1`` for none (and past ``C_i``).
        caps: ``[n]`` int64, ``C_i``; ``Cmax = held.shape[1] = max(caps)``.
        alpha: ``[n, 1]`` float, each row's margin.

    Returns:
        ``chosen`` ``[n, Cmax]`` int64: row ``i``'s tokens ascending in ``[:C_i]``, then ``Tmax``;
        ``src`` ``[n, Cmax]`` int64: the staging row holding ``chosen`` now, or ``-1`` (only on the host).
    """
    n, tmax = score.shape
    cmax = held.shape[1]
    live = held >= 0
    row_of = torch.arange(n, device=score.device)[:, None].expand_as(held)
    col = torch.arange(cmax, device=score.device)[None, :].expand_as(held)
    where = torch.full((n, tmax + 1), -1, dtype=torch.int64, device=score.device)  # column Tmax: padding
    where[row_of[live], held[live]] = col[live]
    staged = where[:, :tmax] >= 0
    fetch = score >= score.amax(dim=1, keepdim=True) - alpha
    # float64: a tier's offset must not swallow the scores' differences (float32 steps by 128 at 2e9)
    rank = score.double() + _RANK_STEP * (2 * fetch.double() + staged.double())  # padding stays -inf
    chosen = torch.where(col < caps[:, None], rank.topk(cmax, dim=1).indices, tmax).sort(dim=1).values
    return chosen, where.gather(1, chosen)


@dataclass(frozen=True, slots=True)
class Speculation:
    """What speculation needs from the model: its weights (for the next layer's query) and its skew tables
    on the KV pool's device."""

    model: LlamaForCausalLM
    tables: SkewTables


@dataclass(frozen=True, slots=True, eq=False)
class _Plan:
    """One step's rows with offloaded KV, side by side (the same all through the step's layers: offloads
    happen after the step). ``source``: the step's row list it was built for."""

    source: list[Row]
    rows: list[Row]
    batch_rows: torch.Tensor  # [n] int64: each row's index in the step's decode batch
    cap_list: list[int]  # C_i: staging rows
    caps: torch.Tensor  # [n] int64
    cmax: int
    staging: torch.Tensor  # [n, cmax / B] int64 device block ids (0 past a row's own)
    host: torch.Tensor  # [n, tmax / B] int64 host slots (0 past a row's own)
    alpha: torch.Tensor  # [n, 1] float32: each row's speculation_alpha

    @staticmethod
    def build(source: list[Row], rows: list[Row], bs: int, device: torch.device) -> _Plan:
        def padded(lists: list[list[int]]) -> torch.Tensor:
            width = max(len(v) for v in lists)
            return torch.tensor([v + [0] * (width - len(v)) for v in lists], dtype=torch.int64, device=device)

        caps = [len(r.state.staging) * bs for r in rows]
        alphas = [r.seq.long_context.speculation_alpha for r in rows]  # type: ignore[union-attr]
        return _Plan(source, rows, torch.tensor([r.row for r in rows], dtype=torch.int64, device=device), caps,
                     torch.tensor(caps, dtype=torch.int64, device=device), max(caps),
                     padded([r.state.staging for r in rows]), padded([r.state.host_slots for r in rows]),
                     torch.tensor(alphas, dtype=torch.float32, device=device)[:, None])


@dataclass(slots=True, eq=False)
class SpeculativeState(InfiniGenState):
    """`InfiniGenState` plus the partial key cache and the tokens held by each layer's staging rows."""

    partial_keys: torch.Tensor | None = None  # [L, T_off, Hkv, R] in the KV dtype, offloaded tokens in order
    staged_tokens: list[torch.Tensor] = field(default_factory=list)  # [layer]: [C] int64 token per row, -1: none


class SpeculativeInfiniGen(InfiniGen):
    """``policy: infinigen, selection: speculative`` (see the module doc). One instance per engine; its
    prefetch thread is the only other thread that touches a sequence's staging rows, one layer at a time."""

    def __init__(self, owner: PolicyHost) -> None:
        super().__init__(owner)
        self.speculation: Speculation | None = None  # set by `use_skew` before the first such sequence
        self._executor: ThreadPoolExecutor | None = None
        # layer → its prefetch: the future, its done event (CUDA), and its inputs, made on the main stream and
        # read on the side stream, kept alive until the main stream has waited for that event
        self._pending: dict[int, tuple[Future[int], torch.cuda.Event | None, object]] = {}
        self._side: torch.cuda.Stream | None = None
        self._plan: _Plan | None = None  # this step's; dropped by `end_step`

    def use_skew(self, model: LlamaForCausalLM, fingerprint: str, tables: SkewTables) -> None:
        """Speculate with ``tables`` from now on (moved to the KV pool's device once).

        Raises:
            ValueError: the tables were made for other weights, or do not fit the model's shapes.
        """
        cfg = model.config
        if tables.model_fingerprint != fingerprint:
            raise ValueError(f"skew tables of model {tables.model_fingerprint[:16]}, not of this one "
                             f"({fingerprint[:16]})")
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
        if tuple(tables.rotations.shape) != want:
            raise ValueError(f"skew rotations of shape {tuple(tables.rotations.shape)}; this model needs {want}")
        self.speculation = Speculation(model, tables.to(self.owner.kv_pool.device))

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
        """Before the victims leave the device: append their partial keys (every layer, from the keys in the
        pool, which carry their rotary position) to the partial key cache."""
        assert isinstance(state, SpeculativeState) and self.speculation is not None
        pool = self.owner.kv_pool
        ids = torch.tensor(victims, dtype=torch.int64, device=pool.device)
        keys = pool.index_select(0, ids)[:, :, 0]  # [m, L, Hkv, B, D]
        m, num_layers, heads, bs, dim = keys.shape
        rows = keys.permute(1, 0, 3, 2, 4).reshape(num_layers, m * bs, heads, dim)  # tokens in order
        new = torch.stack([partial_keys(self.speculation.tables, layer, rows[layer])
                           for layer in range(num_layers)]).to(pool.dtype)  # the KV's dtype: half the bytes in bf16
        state.partial_keys = new if state.partial_keys is None else torch.cat([state.partial_keys, new], dim=1)

    def after_offload(self, state: InfiniGenState) -> None:
        """Widen each layer's staging map to the staging blocks `InfiniGen.enforce` added (new rows: -1,
        filled by the next recall)."""
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
    def _plan_for(self, rows: list[Row]) -> _Plan | None:
        """The step's `_Plan` (built at its first call: ``rows`` is the same list at every layer), or None
        when no row has offloaded KV."""
        if self._plan is not None and self._plan.source is rows:
            return self._plan
        todo = [r for r in rows if r.state.host_slots]
        self._plan = _Plan.build(rows, todo, self.owner.spec.block_size_tokens, self.owner.kv_pool.device) \
            if todo else None
        return self._plan

    def layer_input(self, layer: int, rows: list[Row], x: torch.Tensor,
                    cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Layer ``layer``'s input ``x`` ``[Nd, hidden]`` (the step's decode rows): speculate layer
        ``layer + 1``'s tokens for every row with offloaded KV and start their prefetch."""
        nxt = layer + 1
        if nxt >= self.owner.spec.num_layers or nxt < SPECULATE_FROM:
            return
        plan = self._plan_for(rows)
        if plan is None:
            return
        assert self.speculation is not None
        cos, sin = cos_sin
        q = speculation_query(self.speculation.model, nxt, x.index_select(0, plan.batch_rows),
                              (cos.index_select(0, plan.batch_rows), sin.index_select(0, plan.batch_rows)))
        q_part = partial_query(self.speculation.tables, nxt, q)  # [n, Hq, R]
        if nxt in self._pending:  # left by a step that raised midway
            self.end_step()
        self._pending[nxt] = (*self._submit(lambda: self._recall(nxt, plan, q_part)), (plan, q_part))

    def before_decode(self, layer: int, rows: list[Row], q: torch.Tensor) -> None:
        """Layers before `SPECULATE_FROM` (or a layer whose prefetch was not started): select with the
        layer's own query and copy now. Others: wait for the prefetch started at the previous layer."""
        pending = self._pending.pop(layer, None)
        if pending is not None:
            future, done, _inputs = pending
            self.owner.stats.recalled_token_rows += future.result()
            if done is not None:
                torch.cuda.current_stream(self.owner.kv_pool.device).wait_event(done)
            return
        plan = self._plan_for(rows)
        if plan is None:
            return
        assert self.speculation is not None
        q_part = partial_query(self.speculation.tables, layer, q.index_select(0, plan.batch_rows))
        self.owner.stats.recalled_token_rows += self._recall(layer, plan, q_part)

    def _submit(self, job: Callable[[], int]) -> tuple[Future[int], torch.cuda.Event | None]:
        """Run ``job`` on the prefetch thread (on CUDA: on a side stream after the main stream's work so far;
        the returned event marks its copies done)."""
        if self._executor is None:
            # One intra-op thread there: the main thread's matmuls already use every core, and two OpenMP
            # teams on them slow both (measured: 2x on the main thread's matmuls on 2 cores). Setting it also
            # sets the default of threads started later, so the caller's count is put back once it is set.
            threads = torch.get_num_threads()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvrelay-prefetch",
                                                initializer=torch.set_num_threads, initargs=(1,))
            self._executor.submit(lambda: None).result()
            torch.set_num_threads(threads)
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
    def _recall(self, layer: int, plan: _Plan, q_part: torch.Tensor) -> int:
        """Select and copy layer ``layer``'s staging rows of every row of ``plan`` at once (``q_part``
        ``[n, Hq, R]``: their partial queries for this layer); returns the token rows read from the host.

        Per row ``i`` with ``T_i`` offloaded tokens and ``C_i`` staging rows, side by side, padded::

            score [n, Tmax]   best head's partial logit per offloaded token (-inf past T_i)
            rank              score + 2·STEP if within alpha of the row's best (fetch) + STEP if staged now
            chosen [n, Cmax]  the C_i best ranks, in token order (then padding)
            src               each chosen token's current staging row, or -1 (on the host only)
        """
        owner, bs = self.owner, self.owner.spec.block_size_tokens
        n, cmax = len(plan.rows), plan.cmax
        heads = owner.spec.num_kv_heads
        qg = q_part.reshape(n, heads, -1, q_part.shape[-1])  # [n, Hkv, G, R]
        keys = [r.state.partial_keys[layer] for r in plan.rows]
        per_row = [torch.einsum("hgr,thr->thg", qg[i].to(k.dtype), k).flatten(1).amax(1).float()
                   for i, k in enumerate(keys)]
        score = pad_sequence(per_row, batch_first=True, padding_value=float("-inf")) * owner.scale
        held = pad_sequence([r.state.staged_tokens[layer] for r in plan.rows], batch_first=True, padding_value=-1)
        chosen, src = select_rows(score, held, plan.caps, plan.alpha)
        col = torch.arange(cmax, device=score.device)[None, :]
        in_row = col < plan.caps[:, None]
        move = in_row & (src >= 0) & (src != col)
        fetched = in_row & (src < 0)
        layer_pool = owner.kv_pool[:, layer]  # [N, 2, Hkv, B, D]
        r_m, j_m = move.nonzero(as_tuple=True)
        if r_m.numel():
            s_m = src[move]
            moved = layer_pool[plan.staging[r_m, s_m // bs], :, :, s_m % bs]  # a copy: read before writing
            layer_pool[plan.staging[r_m, j_m // bs], :, :, j_m % bs] = moved
            if layer_pool.is_cuda:  # a NIXL copy below is not ordered after the queued moves: finish them
                torch.cuda.current_stream(layer_pool.device).synchronize()
        r_f, j_f = fetched.nonzero(as_tuple=True)
        t_f = chosen[fetched]
        if r_f.numel():
            owner.copy_rows("host", plan.host[r_f, t_f // bs].tolist(), (t_f % bs).tolist(), "device",
                            plan.staging[r_f, j_f // bs].tolist(), (j_f % bs).tolist(), layer=layer)
            if owner.store.integrity.enabled:
                self._check_sources(layer, plan, r_f, t_f // bs)
        new_held = torch.where(in_row, chosen, -1)  # this layer's staging map from now on
        for i, r in enumerate(plan.rows):
            r.state.staged_tokens[layer] = new_held[i, : plan.cap_list[i]]
        return int(r_f.numel())

    def _check_sources(self, layer: int, plan: _Plan, rows: torch.Tensor, offloaded: torch.Tensor) -> None:
        """Hash a pick of the host slices (row's offloaded block, ``layer``) that rows were just read from and
        compare with their digests from the offload; a mismatch flags that row's sequence (module doc)."""
        store = self.owner.store
        assert store.host is not None
        pairs = sorted(set(zip(rows.tolist(), offloaded.tolist(), strict=True)))
        pairs = [(i, b) for i, b in pairs if plan.rows[i].state.slice_digests]
        picked = [pairs[k] for k in store.integrity.pick(len(pairs), self._rng)]
        if not picked:
            return
        store.integrity_checked("recall", len(picked))
        slots = [plan.rows[i].state.host_slots[b] for i, b in picked]
        got = digest_slices(store.host.pool, slots, [layer] * len(picked))
        for (i, b), slot, digest in zip(picked, slots, got, strict=True):
            want = plan.rows[i].state.slice_digests[b][layer]
            if digest != want:
                seq = plan.rows[i].seq
                seq.kv_corrupt = True
                store.integrity_failure(
                    "recall", PRIVATE_BLOCK, f"request {seq.request_id} sample {seq.index}, host slot {slot}, "
                    f"layer {layer}: digest {digest:016x}, expected {want:016x}")

    def end_step(self) -> None:
        """After every step's forward, whether it returned or raised: wait for prefetches nobody waited for (a
        forward that raised midway) and their device work, so that no copy outlives its step and writes into
        blocks the failed step's requests give back; drop the step's plan. Never raises (their errors are
        logged: the step's own error is the one that matters)."""
        pending, self._pending = self._pending, {}
        for future, done, _inputs in pending.values():
            try:
                self.owner.stats.recalled_token_rows += future.result()
            except Exception:  # noqa: BLE001 - a stale prefetch of a failed step
                log.exception("a prefetch of a failed step failed too")
            if done is not None:
                done.synchronize()
        self._plan = None

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
