"""`kv_block_spec`: the KV block layout of a model, the one builder (the engine and ``kvrelay store`` both
call it; ``kvrelay store`` without loading the weights)."""

from __future__ import annotations

from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.model.config import ModelConfig


def kv_block_spec(cfg: ModelConfig, *, fingerprint: str, block_size_tokens: int, dtype: str) -> BlockSpec:
    """The KV block layout of a model: every layer of each `ModelConfig.kv_groups` group in one block, each
    layer as `ModelConfig.kv_planes` says (K and V heads, or MLA's one latent row); the one builder: the engine
    and ``kvrelay store`` both call it."""
    groups = cfg.kv_groups
    planes, heads, width = cfg.kv_planes
    return BlockSpec(num_layers=len(groups[0].layers), num_kv_heads=heads, head_dim=width,
                     block_size_tokens=block_size_tokens, dtype=dtype, model_fingerprint=fingerprint,
                     num_groups=len(groups), num_planes=planes)
