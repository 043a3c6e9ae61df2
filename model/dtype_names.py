"""Weight and KV dtype names (no torch: configs are checked with these before any model loads)."""

from __future__ import annotations

DTYPE_NAMES: tuple[str, ...] = ("bfloat16", "float16", "float32")
AUTO = "auto"
DTYPE_CHOICES: tuple[str, ...] = (AUTO, *DTYPE_NAMES)
PULL_DTYPES: tuple[str, ...] = ("bfloat16", "float32")  # what `kvrelay model pull --dtype` writes
