"""`ModelRunner`: turns a `ScheduledStep` into one model forward over the paged KV pool."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from kvrelay.engine.block_tables import NULL_BLOCK
from kvrelay.engine.cuda_graphs import DecodeGraphs, DecodeRow
from kvrelay.engine.prompt_logprobs import ChunkPromptLogprobs, chunk_prompt_logprobs, wants_prompt_logprobs
from kvrelay.engine.scheduler import ScheduledStep
from kvrelay.engine.sequence import Sequence
from kvrelay.model.attention import AttentionBackend, AttentionBatch, KvHook


@dataclass(frozen=True, slots=True)
class StepLogits:
    """Logits of the sequences that pick a token this step, in ``seqs`` order: ``[len(seqs), vocab]``; and, where
    the model found them with the logits, each row's ``torch.argmax`` (``greedy``; else None). ``prompt_logprobs``:
    what this step's prefill chunks of sequences that asked for their prompt's logprobs produced
    (`engine.prompt_logprobs`; empty for every other step)."""

    seqs: list[Sequence]
    logits: torch.Tensor
    greedy: list[int] | None = None
    prompt_logprobs: list[ChunkPromptLogprobs] = field(default_factory=list)


class ModelRunner:
    """Builds the step's flat token batch and `AttentionBatch`, runs the model, returns the logits needed.

    Args:
        model: a `model.llama.LlamaForCausalLM` (``forward(input_ids, positions, kv_pool, batch, backend)``).
        kv_pool: ``[num_blocks, L, P, H, B, D]`` (`kvstore.block_spec`) on the model's device; written by the model.
        backend: attention backend.
        block_size_tokens: B.
        num_groups: G, the table entries per 16-token block (`kvstore.block_spec`): with G > 1 each group
            gets its own tables and slots (entries ``g::G`` of a sequence's table), in
            `AttentionBatch.group_batches`. `engine.block_tables.NULL_BLOCK` entries (out-of-window blocks
            given back) go to the kernels as block 0, which they never read.
        gives_back_blocks: some group has a sliding window (`engine.scheduler.Scheduler.drop_out_of_window`),
            so tables may hold `NULL_BLOCK`.

    ``graphs``: captured decode steps (`engine.cuda_graphs.DecodeGraphs`), set by the engine on CUDA; a
    decode-only step without a long-context policy replays one when its batch fits, else runs eagerly. A
    decode-only step without a KV hook runs through the model's ``decode_logits`` where it has one and its
    ``fuses_decode_logits`` accepts the step (else through `forward`).
    """

    def __init__(
        self, model: torch.nn.Module, kv_pool: torch.Tensor, backend: AttentionBackend, *, block_size_tokens: int,
        num_groups: int = 1, gives_back_blocks: bool = False,
    ) -> None:
        self.num_groups = num_groups
        self.gives_back_blocks = gives_back_blocks  # tables may hold NULL_BLOCK (a sliding group's blocks)
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.block_size_tokens = block_size_tokens
        self.device = kv_pool.device
        self.graphs: DecodeGraphs | None = None
        # a decode-only step's logits in one call where the model has one (`LlamaForCausalLM.decode_logits`)
        self.fuses_logits = hasattr(model, "fuses_decode_logits")
        # a decode-only step's prefill lengths, query starts and block tables: the same empty tensors every step
        # (read, never written), not three new ones (with decode attention's kept scratch, a batch-1 step 0.996x
        # the time, median of 20 alternated rounds: within noise)
        self._no_prefill = (self._tensor([]), self._tensor([0]),
                            torch.zeros(0, 0, dtype=torch.int32, device=self.device))

    def _slot(self, table: list[int], row: int, group: int = 0) -> int:
        """The KV slot of token row ``row`` in KV block group ``group``, from a sequence's block table."""
        bs = self.block_size_tokens
        return table[row // bs * self.num_groups + group] * bs + row % bs

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, seqs: list[Sequence], group: int = 0) -> torch.Tensor:
        g = self.num_groups
        tables = [s.block_table[group::g] if g > 1 else s.block_table for s in seqs]
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        out = torch.tensor(rows, dtype=torch.int32).reshape(len(seqs), width)
        if self.gives_back_blocks and NULL_BLOCK in out:  # never read: any valid id does (see class doc)
            out.clamp_(min=0)
        return out.to(self.device)

    def _step_tables(self, step: ScheduledStep, prefill_lens: list[int], query_start: list[int]
                     ) -> dict[str, torch.Tensor]:
        """`AttentionBatch`'s ``step_*`` tables, for a backend with ``unified_attention`` and a step that
        mixes prefill and decode tokens (else none)."""
        if not (hasattr(self.backend, "unified_attention") and step.prefills and step.decodes):
            return {}
        seqs = [c.seq for c in step.prefills] + list(step.decodes)
        lens = prefill_lens + [s.num_kv_tokens + 1 for s in step.decodes]
        starts = query_start + [query_start[-1] + i for i in range(1, len(step.decodes) + 1)]
        return {"step_block_tables": [self._block_tables(seqs, g) for g in range(self.num_groups)],
                "step_seq_lens": self._tensor(lens), "step_query_start_loc": self._tensor(starts)}

    def run(self, step: ScheduledStep, *, kv_hook: KvHook | None = None) -> StepLogits:
        """One forward. Sequences whose pending tokens all get computed this step also get logits.

        ``kv_hook``: the long-context policies' calls for this step (`engine.kv_policy`), or None.
        """
        decode_only = kv_hook is None and step.decodes and not step.prefills
        if decode_only and self.graphs is not None:
            with torch.inference_mode():
                replayed = self._replay(step.decodes)
            if replayed is not None:
                return replayed
        if (decode_only and self.fuses_logits
                and self.model.fuses_decode_logits(len(step.decodes), self.kv_pool, self.backend)):
            # one C++ call that no autograd sees (no weight needs a gradient): outside inference mode, whose
            # entry and exit cost tens of us of a batch-1 step when run cold
            return self._decode_logits(step.decodes)
        return self._run(step, kv_hook)

    @torch.inference_mode()
    def _run(self, step: ScheduledStep, kv_hook: KvHook | None) -> StepLogits:
        bs, g = self.block_size_tokens, self.num_groups
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(g)]  # per group
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prefill_lens: list[int] = []
        query_start = [0]
        prompt_chunks: list[tuple[Sequence, int, int, int]] = []  # (seq, first row, start, end): prompt logprobs
        for chunk in step.prefills:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            assert seq.num_absent_tokens == 0, "a sequence whose KV a policy dropped cannot prefill"
            end = start + chunk.num_tokens
            if wants_prompt_logprobs(seq):
                prompt_chunks.append((seq, len(input_ids), start, end))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            for group in range(g):
                slots[group].extend(seq.block_table[p // bs * g + group] * bs + p % bs for p in range(start, end))
            prefill_lens.append(end)
            query_start.append(query_start[-1] + chunk.num_tokens)
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        num_prefill_tokens = len(input_ids)
        for seq in step.decodes:
            p, row = seq.num_computed_tokens, seq.num_kv_tokens  # the KV row is behind p once a policy dropped KV
            input_ids.append(seq.token_ids[p])
            positions.append(p)
            for group in range(g):
                slots[group].append(self._slot(seq.block_table, row, group))
            sample_rows.append(len(input_ids) - 1)
            sample_seqs.append(seq)
        no_prefill = self._no_prefill if not step.prefills else None
        common = dict(num_prefill_tokens=num_prefill_tokens,
                      prefill_seq_lens=self._tensor(prefill_lens) if no_prefill is None else no_prefill[0],
                      prefill_query_start_loc=self._tensor(query_start) if no_prefill is None else no_prefill[1],
                      decode_seq_lens=self._tensor([s.num_kv_tokens + 1 for s in step.decodes]), kv_hook=kv_hook)
        step_tables = self._step_tables(step, prefill_lens, query_start)

        def of_group(group: int) -> dict:  # the unified kernel's tables, with this group's block tables
            return {**step_tables, "step_block_tables": step_tables["step_block_tables"][group]} if step_tables else {}

        batches = [
            AttentionBatch(
                slot_mapping=self._tensor(slots[group], torch.int64),
                prefill_block_tables=(self._block_tables([c.seq for c in step.prefills], group) if no_prefill is None
                                      else no_prefill[2]),
                decode_block_tables=self._block_tables(step.decodes, group),
                **common, **of_group(group),
            )
            for group in range(g)
        ]
        batch = batches[0] if g == 1 else dataclasses.replace(batches[0], group_batches=tuple(batches))
        hidden = self.model(self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), self.kv_pool,
                            batch, self.backend)
        prompt = [chunk_prompt_logprobs(self.model, hidden[row : row + end - start], seq, start=start,
                                        num_top=seq.params.prompt_logprobs or 0)
                  for seq, row, start, end in prompt_chunks]
        if sample_rows != list(range(hidden.shape[0])):  # a decode-only step samples every row: no gather
            hidden = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.int64, device=hidden.device))
        return StepLogits(sample_seqs, self.model.compute_logits(hidden), prompt_logprobs=prompt)

    def _decode_logits(self, decodes: list[Sequence]) -> StepLogits:
        """A decode-only step (every row samples) through the model's ``decode_logits``: its metadata as lists,
        read in the same call that runs the step (no tensor or `AttentionBatch` built for it here)."""
        g = self.num_groups
        ids, positions, lens = [], [], []
        slots: list[list[int]] = [[] for _ in range(g)]
        tables: list[list[list[int]]] = [[] for _ in range(g)]
        for seq in decodes:
            p, row = seq.num_computed_tokens, seq.num_kv_tokens  # the KV row is behind p once a policy dropped KV
            ids.append(seq.token_ids[p])
            positions.append(p)
            lens.append(row + 1)
            table = seq.block_table
            for group in range(g):
                slots[group].append(self._slot(table, row, group))
                own = table[group::g] if g > 1 else table
                # a given-back block is never read: any valid id does (see class doc)
                tables[group].append([max(b, 0) for b in own] if self.gives_back_blocks else own)
        logits, greedy = self.model.decode_logits(ids, positions, self.kv_pool, slots, tables, lens)
        return StepLogits(list(decodes), logits, greedy)

    def _decode_row(self, seq: Sequence) -> DecodeRow:
        """A decoding sequence's next token, its position, and the slot and KV length its KV gets (its KV
        row is behind its position once a long-context policy dropped KV)."""
        p, row = seq.num_computed_tokens, seq.num_kv_tokens
        return DecodeRow(seq.token_ids[p], p, self._slot(seq.block_table, row), row + 1, seq.block_table)

    def _replay(self, decodes: list[Sequence]) -> StepLogits | None:
        """A decode-only step through ``self.graphs``, or None when it does not fit one."""
        assert self.graphs is not None
        rows = [self._decode_row(seq) for seq in decodes]
        if self.graphs.size_for(len(rows)) is None:
            return None
        logits = self.graphs.run(rows)
        return None if logits is None else StepLogits(list(decodes), logits)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer of block ``src`` into block ``dst``."""
        self.kv_pool[dst].copy_(self.kv_pool[src])
