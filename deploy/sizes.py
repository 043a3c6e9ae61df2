"""Byte sizes in config files ("8GiB", "512MiB", 4096) and the config error type."""

from __future__ import annotations

import re
from typing import Any

UNIT_TO_BYTES: dict[str, int] = {
    "": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
}
# Binary units only: "8GB" is refused rather than guessed at (GB or GiB?).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]iB|B)?\s*$")


class ConfigError(ValueError):
    """A bad config value; the message starts with the YAML key path."""


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like ``"8GiB"``.

    Raises:
        ValueError: "is not a size; use e.g. "8GiB"" (callers prefix the key path).
    """
    if isinstance(value, bool):
        raise ValueError('is not a size; use e.g. "8GiB"')
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("must be positive")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            n = int(float(m.group(1)) * UNIT_TO_BYTES[m.group(2) or ""])
            if n > 0:
                return n
    raise ValueError('is not a size; use e.g. "8GiB"')
