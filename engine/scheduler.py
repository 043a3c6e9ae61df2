"""`Scheduler`: which sequences run in the next step, and the blocks they write into.

Each step runs every decode-ready sequence (one token each) plus prefill chunks, first-come
first-served, under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Long prompts are chunked across steps. With ``prefill_packing: fill`` (the
default) prompts pack up to the budget. With ``priced``, once a prompt finishes its prefill in a step,
a later prompt joins that step only where the engine's measured step cost (``fixed_s +
prefill_token_s · tokens + decode_row_s · rows``) says so: it would delay the first token of each of
the ``k`` prompts finishing in the step by its own compute, and saves one step (``fixed_s +
decode_row_s · R``, with the step's ``R`` decode rows) for itself and for each of the ``m`` prompts
queued from it on, so it joins when ``k · tokens · prefill_token_s ≤ m · (fixed_s + decode_row_s ·
R)`` and it finishes in the step too. On a CPU a step's time grows with its tokens, so two prompts
packed into one step both get their first token at the end of both (1P1D on a Zen 4 VM, long mix at
1.5 req/s: a 367-token prompt's compute took 1.09 s beside a 485-token one); in one engine, three
prompts arriving together got their first tokens 0.85× as late on average with ``priced``. Not the
default: in served goodput runs it did not pay on the long mix and lost at the mixed workload's knee,
with the decode rows priced or not (`docs/benchmarks.md`, stop 61). A waiting prompt that shares a block with
a prompt still being prefilled waits for it (later arrivals may go first meanwhile), so a prefix that
many requests bring at once is computed once and then read from the prefix cache. When a decode
needs a block and none is free, the most recently arrived running sequence is preempted by
recompute: its blocks are released (full ones stay in the prefix cache), and it re-enters the
waiting queue at its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.engine.block_tables import BlockTables, held
from kvrelay.engine.prompt_logprobs import wants_prompt_logprobs
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.kvstore.block_key import BlockKey, extend_group_keys
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.tiered_store import TieredStore

CopyBlock = Callable[[int, int], None]
FreeHook = Callable[[Sequence], None]


PREFILL_PACKINGS = ("fill", "priced")  # `SchedulerConfig.prefill_packing` (module docstring)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    prefill_packing: str = "fill"  # one of PREFILL_PACKINGS, checked by `engine.engine_config.EngineConfig`


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    seq: Sequence
    num_tokens: int  # tokens of seq.token_ids[seq.num_computed_tokens:] computed this step


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    prefills: list[PrefillChunk]
    decodes: list[Sequence]
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Owns the waiting and running lists and every sequence's block table (written through
    ``self.tables``, the `BlockTables` the engine and the long-context policies share).

    Args:
        config: limits.
        store: the tiered KV store; its device `BlockPool` holds the blocks (ref counts stay its
            business) and its lower tiers answer prefix lookups the device misses.
        tables: writes every block table (over ``store``'s block pool).
        spec: the block layout (block size; its fingerprint enters every block key).
        copy_block: ``copy_block(src, dst)`` copies a block's bytes (copy-on-write of a shared tail).
        on_free: ``on_free(seq)`` runs whenever a sequence's blocks are released (finish, preemption,
            giving back holds): a long-context policy drops its state for the sequence there.
    """

    def __init__(
        self, config: SchedulerConfig, store: TieredStore, *, tables: BlockTables, spec: BlockSpec,
        copy_block: CopyBlock, on_free: FreeHook | None = None, group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        if len(group_windows) != spec.num_groups:
            raise ValueError(f"{len(group_windows)} group windows for {spec.num_groups} KV block groups")
        self.config = config
        self.groups = spec.num_groups  # G: table entries per 16-token block (kvstore.block_spec)
        self.sliding = [(g, w) for g, w in enumerate(group_windows) if w is not None]
        self.store = store
        self.pool = store.block_pool
        self.tables = tables
        self.spec = spec
        self.copy_block = copy_block
        self.on_free = on_free
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_prefix_hit_tokens = 0  # tokens whose KV came from the prefix cache at admission
        self.num_prefix_query_tokens = 0  # tokens looked up in the prefix cache at admission
        # ``(fixed_s, prefill_token_s, decode_row_s)`` of a step as the engine measured it
        # (`engine.step_rates.StepCost`), for ``prefill_packing: priced``; None, or no fixed or per-token cost
        # fitted yet: prompts pack up to the budget
        self.step_cost: Callable[[], tuple[float, float, float]] | None = None

    # ---------------------------------------------------------------- admission
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.arrival)

    def add_running(self, seq: Sequence) -> None:
        """Join an already-prefilled sequence (a fork) to the running list."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=lambda s: s.arrival)

    def keys_of(self, seq: Sequence) -> list[BlockKey]:
        """Keys of every full block of ``seq.token_ids`` (computed incrementally, cached on the sequence)."""
        return extend_group_keys(
            seq.block_keys, seq.token_ids, num_groups=self.groups, block_size_tokens=self.spec.block_size_tokens,
            spec_fingerprint=self.spec.fingerprint, salt=seq.salt,
        )

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse cached blocks for the leading full blocks; at least one token is always computed.

        With prefix caching off, only blocks the caller handed over (pulled KV, ``pinned_block_ids``)
        are matched. A prompt whose logprobs are asked for matches nothing: it is computed in full, since
        cached rows have no logits (`engine.prompt_logprobs`).
        """
        seq.prefix_matched = True
        if (not self.config.enable_prefix_caching and not seq.pinned_block_ids) or wants_prompt_logprobs(seq):
            return
        bs, g = self.spec.block_size_tokens, self.groups
        keys = self.keys_of(seq)[: (len(seq.token_ids) - 1) // bs * g]
        self.num_prefix_query_tokens += len(seq.token_ids)
        hit = self.store.load(keys, self.store.match_prefix(keys))  # acquired; lower tiers promoted
        if len(hit) % g:  # every group's block of a 16-token block, or none of them
            self.pool.release(hit[len(hit) - len(hit) % g :])
            hit = hit[: len(hit) - len(hit) % g]
        if seq.num_output_tokens == 0:
            self.store.record_prompt(len(seq.token_ids), len(hit) // g * bs)
            if not seq.tail_scored:  # a prompt matched again after a preemption is not replayed twice
                seq.cold_from = self.store.cold_from(keys, len(hit))
                seq.tail_scored = True
        self.tables.assign(seq, hit)
        seq.num_keyed_blocks = len(hit)
        seq.num_computed_tokens = len(hit) // g * bs
        self.num_prefix_hit_tokens += seq.num_computed_tokens
        if seq.num_output_tokens == 0:
            seq.num_cached_prompt_tokens = seq.num_computed_tokens

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        decodes: list[Sequence] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if not seq.is_decode or seq.status is not SequenceStatus.RUNNING:
                continue
            while not self._reserve_decode_slot(seq):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                decodes.append(seq)
                budget -= 1
        prefills: list[PrefillChunk] = []
        finishing = 0  # prompts whose prefill ends this step
        price: list[tuple[float, float] | None] = []  # read once a prompt asks to join (a fit costs ~0.15 ms)

        def joins(seq: Sequence, queued: int) -> bool:
            if not price:
                price.append(self._join_price(len(decodes)))
            return self._joins(seq, budget, finishing, queued, price[0])

        partial = [seq for seq in self.running if not seq.is_decode]
        for n, seq in enumerate(partial):
            if budget <= 0:
                break
            if finishing and not joins(seq, len(partial) - n + len(self.waiting)):
                continue
            chunk = self._grow_for_prefill(seq, budget)
            if chunk:
                prefills.append(PrefillChunk(seq, chunk))
                budget -= chunk
                finishing += chunk == seq.num_pending_tokens
        inflight = self._inflight_keys()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if seq in preempted:
                break  # it just lost its blocks; do not take them back in the same step
            if not seq.prefix_matched and self._waits_for(seq, inflight):
                i += 1
                continue
            if not seq.prefix_matched:
                self._match_prefix(seq)
            if finishing and not joins(seq, len(self.waiting) - i):
                i += 1
                continue
            chunk = self._grow_for_prefill(seq, budget)
            if chunk == 0:
                break
            finishing += chunk == seq.num_pending_tokens
            self.waiting.pop(i)
            inflight.update(self._prompt_keys(seq)[seq.num_keyed_blocks :])
            self._drop_pins(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.running.sort(key=lambda s: s.arrival)
            prefills.append(PrefillChunk(seq, chunk))
            budget -= chunk
        return ScheduledStep(prefills, decodes, preempted)

    def _join_price(self, rows: int) -> tuple[float, float] | None:
        """``(step_s, prefill_token_s)`` to price a prompt joining a step of ``rows`` decode rows by: ``step_s`` what
        one more such step costs without prompt tokens (module docstring); None: pack."""
        if self.config.prefill_packing != "priced" or self.step_cost is None:
            return None
        fixed_s, token_s, row_s = self.step_cost()
        return (fixed_s + row_s * rows, token_s) if fixed_s > 0 and token_s > 0 else None

    @staticmethod
    def _joins(seq: Sequence, budget: int, finishing: int, queued: int, price: tuple[float, float] | None) -> bool:
        """Whether ``seq``'s prefill joins a step in which ``finishing`` prompts already end, with ``budget``
        tokens left and ``queued`` prompts (``seq`` and those behind it) still to prefill: it must end in the step
        too and cost the ``finishing`` prompts no more than the steps it saves (module docstring)."""
        if price is None:
            return True
        step_s, token_s = price
        tokens = seq.num_pending_tokens
        return tokens <= budget and finishing * tokens * token_s <= queued * step_s

    def _prompt_keys(self, seq: Sequence) -> list[BlockKey]:
        """Keys of the full blocks of ``seq``'s tokens so far (empty with prefix caching off)."""
        if not self.config.enable_prefix_caching:
            return []
        return self.keys_of(seq)[: len(seq.token_ids) // self.spec.block_size_tokens * self.groups]

    def _inflight_keys(self) -> set[BlockKey]:
        """Keys of full prompt blocks that running prefills will compute but have not keyed yet."""
        out: set[BlockKey] = set()
        for seq in self.running:
            if not seq.is_decode:
                out.update(self._prompt_keys(seq)[seq.num_keyed_blocks :])
        return out

    def _waits_for(self, seq: Sequence, inflight: set[BlockKey]) -> bool:
        """Whether a prompt block of ``seq`` is being computed by another prefill right now."""
        return bool(inflight) and not seq.pinned_block_ids and any(k in inflight for k in self._prompt_keys(seq))

    def _reserve_decode_slot(self, seq: Sequence) -> bool:
        """Make sure the blocks (one per group) for KV row ``num_kv_tokens`` exist and are private, after
        giving back the sliding groups' blocks the row's window no longer reaches."""
        bs, g = self.spec.block_size_tokens, self.groups
        pos = seq.num_kv_tokens
        self.drop_out_of_window(seq, pos)
        if pos // bs * g >= len(seq.block_table):
            return self.tables.grow(seq, g)
        for index in range(pos // bs * g, pos // bs * g + g):
            tail = seq.block_table[index]
            if self.pool.ref_count(tail) > 1:  # shared partial tail after a fork: copy on write
                new = self.pool.try_allocate(1)
                if new is None:
                    return False
                self.copy_block(tail, new[0])
                self.tables.replace(seq, index, index + 1, new)
        return True

    def drop_out_of_window(self, seq: Sequence, pos: int) -> None:
        """Give back each sliding group's blocks that hold only rows before the window of a query at row
        ``pos`` (every later query's window starts later): block i is out once ``(i + 1)·B <= pos − W + 1``.
        The full groups keep theirs. Only decode steps call it: a prefill node publishes every block of the
        prompt, and a prompt's next chunk may still read the window before it."""
        if not self.sliding or seq.num_absent_tokens:
            return
        bs, g = self.spec.block_size_tokens, self.groups
        dead = {group: max(0, (pos - window + 1) // bs) for group, window in self.sliding}
        for group, end in dead.items():
            for i in range(seq.num_dropped_blocks, end):
                self.tables.drop(seq, i * g + group)
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, min(dead.values()))

    def _grow_for_prefill(self, seq: Sequence, budget: int) -> int:
        """Allocate blocks for the next chunk of ``seq``; returns the chunk size (0: nothing fits)."""
        bs, g = self.spec.block_size_tokens, self.groups
        chunk = min(seq.num_pending_tokens, budget)
        start = seq.num_computed_tokens
        have = len(seq.block_table) // g  # 16-token blocks (each a block per group)
        # Only forked samples share a partial tail block, and they fork after the prompt is computed,
        # so a prefill chunk never writes into a shared block.
        free_slots = have * bs - start + self.pool.num_free_blocks // g * bs
        chunk = min(chunk, free_slots)
        if chunk <= 0:
            return 0
        need = (-(-(start + chunk) // bs) - have) * g
        self.tables.grow(seq, need, required=True)
        return chunk

    def preempt(self, seq: Sequence) -> None:
        """Release a running sequence's blocks (full ones stay cached) and queue it for recompute."""
        self.running.remove(seq)
        self.pool.warm(held(seq.block_table))  # recomputed soon: its cold tail must not go first
        self.free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_keyed_blocks = 0
        seq.prefix_matched = False
        self.add(seq)

    def fits_once_outside_blocks_return(self, seq: Sequence) -> bool:
        """Whether ``seq``, the one sequence left that cannot get blocks, would fit the pool but for blocks
        held outside the scheduler (a lease for a peer, a pull in progress): those come back in bounded
        time, so it should wait rather than end."""
        held_outside = self.pool.stats().num_in_use - len(set(held(seq.block_table)))
        needed = -(-(len(seq.token_ids) + 1) // self.spec.block_size_tokens) * self.groups
        return held_outside > 0 and needed <= self.pool.num_blocks

    def release_waiting_holds(self) -> bool:
        """Waiting sequences give back the blocks they hold (prefix matches, pins); they will match the
        prefix cache again when admitted. Returns whether any block was released."""
        released = False
        for seq in self.waiting:
            if seq.block_table or seq.pinned_block_ids:
                released = True
                self.free_blocks(seq)  # its table holds prefix hits only: warm already
                self._drop_pins(seq)
                seq.num_computed_tokens = 0
                seq.num_keyed_blocks = 0
                seq.prefix_matched = False
        return released

    # ----------------------------------------------------------------- updates
    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Record that ``num_tokens`` more tokens of ``seq`` now have KV; key newly full blocks."""
        seq.num_computed_tokens += num_tokens
        if not self.config.enable_prefix_caching or seq.keys_stopped:
            return
        full = seq.num_computed_tokens // self.spec.block_size_tokens * self.groups  # table entries
        if full > seq.num_keyed_blocks:
            keys = self.keys_of(seq)
            cold_from = seq.cold_from if seq.cold_from is not None else full
            new = range(seq.num_keyed_blocks, full)
            self.pool.register_keys([seq.block_table[i] for i in new], [keys[i] for i in new],
                                    [i >= cold_from for i in new])
            seq.num_keyed_blocks = full

    def _drop_pins(self, seq: Sequence) -> None:
        if seq.pinned_block_ids:
            self.pool.release(seq.pinned_block_ids)
            seq.pinned_block_ids = []

    def free_blocks(self, seq: Sequence) -> None:
        if self.on_free is not None:
            self.on_free(seq)
        self.tables.free(seq)
        seq.num_absent_tokens = 0
        seq.num_dropped_blocks = 0
        seq.keys_stopped = False

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove ``seq`` from either list and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        self._drop_pins(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
