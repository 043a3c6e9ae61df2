"""Test helpers: build `AttentionBatch` steps by hand and run a greedy loop over a KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.model.attention import AttentionBatch, make_backend
from kvrelay.model.config import ModelConfig
from kvrelay.model.llama import LlamaForCausalLM

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PrefillPart:
    """``num_new`` tokens of a sequence whose first ``ctx_len`` tokens are already cached."""

    block_table: list[int]
    ctx_len: int
    num_new: int


@dataclass(frozen=True)
class DecodePart:
    """One new token at position ``seq_len - 1``."""

    block_table: list[int]
    seq_len: int


def new_pool(config: ModelConfig, num_blocks: int, *, dtype: str = "float32") -> torch.Tensor:
    spec = BlockSpec(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, block_size_tokens=BLOCK_SIZE, dtype=dtype)
    return spec.new_pool(num_blocks)


def _slots(block_table: list[int], start: int, stop: int) -> list[int]:
    return [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, stop)]


def _table(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width)


def make_batch(prefills: list[PrefillPart], decodes: list[DecodePart]) -> tuple[AttentionBatch, torch.Tensor]:
    """The step's `AttentionBatch` and ``positions`` ``[T]`` (prefill tokens first, then decodes)."""
    slots: list[int] = []
    positions: list[int] = []
    starts = [0]
    for p in prefills:
        slots += _slots(p.block_table, p.ctx_len, p.ctx_len + p.num_new)
        positions += list(range(p.ctx_len, p.ctx_len + p.num_new))
        starts.append(starts[-1] + p.num_new)
    for d in decodes:
        slots += _slots(d.block_table, d.seq_len - 1, d.seq_len)
        positions.append(d.seq_len - 1)
    batch = AttentionBatch(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_prefill_tokens=starts[-1],
        prefill_block_tables=_table([p.block_table for p in prefills]),
        prefill_seq_lens=torch.tensor([p.ctx_len + p.num_new for p in prefills], dtype=torch.int32),
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32),
        decode_block_tables=_table([d.block_table for d in decodes]),
        decode_seq_lens=torch.tensor([d.seq_len for d in decodes], dtype=torch.int32),
    )
    return batch, torch.tensor(positions, dtype=torch.int64)


def shuffled_block_table(num_tokens: int, *, num_blocks: int, seed: int) -> list[int]:
    """Enough distinct, shuffled block ids out of ``num_blocks`` for ``num_tokens`` tokens."""
    needed = -(-num_tokens // BLOCK_SIZE)
    assert needed <= num_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return perm[:needed]


@torch.inference_mode()
def greedy_generate(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Prefill the prompt in one step, then decode one token per step; returns the new tokens."""
    backend = make_backend("reference")
    total = len(prompt_ids) + max_new_tokens
    num_blocks = -(-total // BLOCK_SIZE) + 3
    pool = new_pool(model.config, num_blocks)
    table = shuffled_block_table(total, num_blocks=num_blocks, seed=1)
    batch, positions = make_batch([PrefillPart(table, 0, len(prompt_ids))], [])
    hidden = model(torch.tensor(prompt_ids), positions, pool, batch, backend)
    out = [int(model.compute_logits(hidden[-1:]).argmax(-1))]
    while len(out) < max_new_tokens:
        batch, positions = make_batch([], [DecodePart(table, len(prompt_ids) + len(out))])
        hidden = model(torch.tensor(out[-1:]), positions, pool, batch, backend)
        out.append(int(model.compute_logits(hidden).argmax(-1)))
    return out
