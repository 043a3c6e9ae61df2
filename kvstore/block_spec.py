"""`BlockSpec`: the shape, dtype and model identity of one KV block.

A pool of blocks on any tier is one tensor of shape::

    [num_blocks, num_layers, num_planes, num_kv_heads, block_size_tokens, head_dim]
                             k|v (2), or one latent (1)

so block ``b`` is one contiguous byte range of ``block_bytes`` bytes, and inside it each
``(layer, plane, head)`` is a contiguous ``block_size_tokens x head_dim`` tile. A GQA model caches two
planes, K and V heads; multi-head latent attention (DeepSeek, `model.config.MlaConfig`) caches one plane of
one "head" as wide as its latent row (``kv_lora_rank + qk_rope_head_dim``). Nothing outside `model/` and
`kernels/` reads what a plane means: tiers, records, digests and transfers move the bytes.

With ``num_groups`` G > 1 (a hybrid model: `model.config.ModelConfig.kv_groups`) a block holds one
group's ``num_layers`` layers, and a sequence's 16-token block i is G blocks: its table lists them
group by group (entry ``i·G + g``), each under its own key (`kvstore.block_key.group_key`), so a
sliding group's blocks can be freed while the full group keeps its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from kvrelay.kvstore.checks import require_int
from kvrelay.model.dtype import DTYPE_NAME_TO_TORCH


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """Layout of one KV block.

    ``model_fingerprint`` names the weights the KV was computed with (see
    `model.loader.model_fingerprint`); it enters `fingerprint` so that two models, even of the same
    shape, never read each other's blocks.

    Raises:
        ValueError: a dimension is not positive or the dtype is not one of `DTYPE_NAME_TO_TORCH`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size_tokens: int = 16
    dtype: str = "float32"
    model_fingerprint: str = ""
    num_groups: int = 1
    num_planes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size_tokens", "num_groups", "num_planes"):
            require_int(f"BlockSpec.{name}", getattr(self, name))
        if self.num_planes not in (1, 2):
            raise ValueError(f"BlockSpec.num_planes must be 2 (K and V) or 1 (a latent), got {self.num_planes}")
        if self.dtype not in DTYPE_NAME_TO_TORCH:
            raise ValueError(
                f"BlockSpec.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_NAME_TO_TORCH)}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAME_TO_TORCH[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, num_planes, num_kv_heads, block_size_tokens, head_dim)``."""
        return (self.num_layers, self.num_planes, self.num_kv_heads, self.block_size_tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes in one block: ``P·L·H·B·D·itemsize`` (P: planes; L: the layers of one group)."""
        return (self.num_planes * self.num_layers * self.num_kv_heads * self.block_size_tokens * self.head_dim
                * self.itemsize)

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token across all layers (every group)."""
        return self.num_groups * self.block_bytes // self.block_size_tokens

    def tokens_held(self, num_blocks: int) -> int | None:
        """Tokens that a sequence's first ``num_blocks`` table entries hold (``num_groups`` entries per
        16-token block), or None when ``num_blocks`` is not a whole number of token blocks."""
        if num_blocks % self.num_groups:
            return None
        return num_blocks // self.num_groups * self.block_size_tokens

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def new_pool(self, num_blocks: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed pool tensor of `pool_shape(num_blocks)` on ``device``. Every byte is written now (as vLLM
        allocates its KV at start): memory left for the OS to zero on first touch (``calloc``) cost ~1.1 ms
        of page faults per 368 KB block written while serving here, against 0.1 ms per block up front."""
        return torch.zeros(self.pool_shape(num_blocks), dtype=self.torch_dtype, device=device)

    def num_blocks_for(self, num_bytes: int) -> int:
        """How many whole blocks fit in ``num_bytes``."""
        return num_bytes // self.block_bytes

    @property
    def fingerprint(self) -> bytes:
        """32-byte SHA-256 over a canonical text of every field; stable across processes and hosts."""
        text = (
            f"kvrelay.spec.v1|layers={self.num_layers}|kv_heads={self.num_kv_heads}|head_dim={self.head_dim}"
            f"|block={self.block_size_tokens}|dtype={self.dtype}|model={self.model_fingerprint}"
        )
        if self.num_groups > 1:  # one group: the v1 text, so existing disk tiers and peers stay valid
            text += f"|groups={self.num_groups}"
        if self.num_planes != 2:  # K and V: the v1 text
            text += f"|planes={self.num_planes}"
        return hashlib.sha256(text.encode()).digest()
