"""`GrowingText`: a text that arrives piece by piece and is read by absolute position, each read costing what it
returns (a ``str`` grown with ``+=`` copies everything so far on each piece: quadratic in a long stream)."""

from __future__ import annotations

from bisect import bisect_right


class GrowingText:
    """The pieces appended so far, as one text.

    ``append`` costs the piece; ``text[a:b]`` costs ``b - a`` plus a bisect over the pieces; ``text[p]`` is one
    character; ``str(text)`` joins the whole (once: it is kept). Slices clamp like ``str``'s; steps and negative
    positions are not supported. ``chars_read``: characters handed out by reads so far, the work a reader did
    (tests bound it by the text's length).
    """

    __slots__ = ("_pieces", "_starts", "_len", "_joined", "chars_read")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._starts: list[int] = []  # the position of each piece's first character
        self._len = 0
        self._joined: str | None = None
        self.chars_read = 0

    def append(self, piece: str) -> None:
        if piece:
            self._starts.append(self._len)
            self._pieces.append(piece)
            self._len += len(piece)
            self._joined = None

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        if self._joined is None:
            self._joined = "".join(self._pieces)
            self._pieces, self._starts = [self._joined] if self._joined else [], [0] if self._joined else []
        return self._joined

    def __getitem__(self, key: int | slice) -> str:
        if isinstance(key, int):
            if not 0 <= key < self._len:
                raise IndexError(f"position {key} is outside the text's {self._len} characters")
            return self[key:key + 1]
        assert key.step is None and (key.start or 0) >= 0 and (key.stop or 0) >= 0, "plain forward slices only"
        start = key.start or 0
        stop = self._len if key.stop is None else min(key.stop, self._len)
        if start >= stop:
            return ""
        i = bisect_right(self._starts, start) - 1
        parts = []
        pos = start
        while pos < stop:
            piece, base = self._pieces[i], self._starts[i]
            parts.append(piece[pos - base:stop - base])
            pos = base + len(piece)
            i += 1
        out = parts[0] if len(parts) == 1 else "".join(parts)
        self.chars_read += len(out)
        return out

    def find(self, sub: str, start: int) -> int:
        """The first position ≥ ``start`` where ``sub`` is, or -1 (costs the text from ``start`` on)."""
        i = self[start:].find(sub)
        return -1 if i < 0 else start + i
