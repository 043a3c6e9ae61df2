"""Helpers of the tiered-store tests: a small spec, deterministic blocks and keys."""

from __future__ import annotations

import torch
from kvrelay.kvstore.block_key import BlockKey, block_keys
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.tiered_store import TieredStore

SPEC = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4, model_fingerprint="test")


def chain(num_blocks: int, *, first_token: int = 0, spec: BlockSpec = SPEC) -> list[BlockKey]:
    """Keys of a prompt of ``num_blocks`` full blocks whose tokens start at ``first_token``."""
    tokens = list(range(first_token, first_token + num_blocks * spec.block_size_tokens))
    return block_keys(tokens, block_size_tokens=spec.block_size_tokens, spec_fingerprint=spec.fingerprint)


def block_value(i: int, *, spec: BlockSpec = SPEC) -> torch.Tensor:
    """A block whose every element encodes ``i`` and its position (distinct blocks, exact compare)."""
    n = 1
    for d in spec.block_shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) * 1e-3 + i).reshape(spec.block_shape).to(spec.torch_dtype)


def write_blocks(store: TieredStore, keys: list[BlockKey], values: list[torch.Tensor]) -> list[int]:
    """Compute-and-register ``keys`` into fresh device blocks (ref 1 each, for the caller to release)."""
    ids = store.block_pool.allocate(len(keys))
    for block_id, key, value in zip(ids, keys, values):
        store.device_pool[block_id].copy_(value)
        assert store.block_pool.register_key(block_id, key)
    return ids
