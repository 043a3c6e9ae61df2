"""Disk admission policies: which blocks leaving ``host`` are worth writing to ``disk``.

Spelled in config as ``all`` or ``seen>=N``; `parse_admission` turns the text into a policy.
A block is *seen* once each time its key is part of a `TieredStore.match_prefix` query (one per
prompt), so ``seen>=2`` writes only blocks that at least two prompts contained.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from kvrelay.kvstore.block_key import BlockKey


class AdmissionPolicy(Protocol):
    """``record_seen(keys)`` counts one sighting of each key; ``admit(key)`` says whether to write it."""

    def record_seen(self, keys: Sequence[BlockKey]) -> None: ...

    def admit(self, key: BlockKey) -> bool: ...


class AdmitAll:
    """Every demoted block goes to disk."""

    def record_seen(self, keys: Sequence[BlockKey]) -> None:
        return None

    def admit(self, key: BlockKey) -> bool:
        return True


class AdmitSeenAtLeast:
    """Blocks seen in at least ``min_seen`` queries go to disk.

    Sightings are kept for the ``max_tracked_keys`` most recently seen keys (LRU), so memory is bounded.
    """

    def __init__(self, min_seen: int, *, max_tracked_keys: int = 1 << 18) -> None:
        if min_seen < 1:
            raise ValueError(f"seen>=N needs N >= 1, got {min_seen}")
        self.min_seen = min_seen
        self.max_tracked_keys = max_tracked_keys
        self._key_to_seen: OrderedDict[BlockKey, int] = OrderedDict()  # first = least recently seen

    def record_seen(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self._key_to_seen[key] = self._key_to_seen.pop(key, 0) + 1
        while len(self._key_to_seen) > self.max_tracked_keys:
            self._key_to_seen.popitem(last=False)

    def admit(self, key: BlockKey) -> bool:
        return self._key_to_seen.get(key, 0) >= self.min_seen


_SEEN_RE = re.compile(r"seen\s*>=\s*(\d+)")

ADMISSION_NAME_TO_FACTORY: dict[str, Callable[[str], AdmissionPolicy]] = {
    "all": lambda _text: AdmitAll(),
    "seen": lambda text: AdmitSeenAtLeast(int(_SEEN_RE.fullmatch(text).group(1))),  # type: ignore[union-attr]
}


def parse_admission(text: str) -> AdmissionPolicy:
    """``"all"`` → `AdmitAll`; ``"seen>=N"`` (N ≥ 1) → `AdmitSeenAtLeast`.

    Raises:
        ValueError: any other text, with the accepted spellings.
    """
    norm = text.strip().lower() if isinstance(text, str) else ""
    name = "all" if norm == "all" else "seen" if _SEEN_RE.fullmatch(norm) and int(norm.split(">=")[1]) >= 1 else None
    if name is None:
        raise ValueError(f'{text!r} is not an admission policy; use "all" or "seen>=N" with N >= 1, e.g. "seen>=2"')
    return ADMISSION_NAME_TO_FACTORY[name](norm)
