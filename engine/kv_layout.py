"""`kv_block_spec`: the KV block layout of a model, the one builder (the engine and ``kvrelay store`` both
call it; ``kvrelay store`` without loading the weights)."""

from __future__ import annotations

from kvstore.block_spec import BlockSpec
from model.config import ModelConfig


def kv_block_spec(cfg: ModelConfig, *, fingerprint: str, block_size_tokens: int, dtype: str) -> BlockSpec:
    """The KV block layout of a model: every layer of each `ModelConfig.kv_groups` group in one block (the
    one builder: the engine and ``kvrelay store`` both call it)."""
    groups = cfg.kv_groups
    return BlockSpec(num_layers=len(groups[0].layers), num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                     block_size_tokens=block_size_tokens, dtype=dtype, model_fingerprint=fingerprint,
                     num_groups=len(groups))
