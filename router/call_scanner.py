"""`CallScanner`: where a tool call's name and arguments are in a JSON object whose text is still arriving
(`router.tool_calls` frames the calls; this reads one)."""

from __future__ import annotations

import json
from typing import Protocol, overload

ARGS_KEYS = ("arguments", "parameters")  # either names a call's arguments


def partial_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may still become ``tag``)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Text(Protocol):
    """What a scanner reads: a ``str``, or a `GrowingText` (slices cost what they return)."""

    def __len__(self) -> int: ...

    @overload
    def __getitem__(self, key: int) -> str: ...

    @overload
    def __getitem__(self, key: slice) -> str: ...


class CallScanner:
    """Scans one JSON object ``{"name": N, "arguments": A, ...}`` of a growing text, each character once, and
    says where N and A are before the object is complete.

    Positions index the shared text. ``bad``: the text is not an object of this shape (brackets are counted,
    not matched, while scanning: `valid` checks the complete object with ``json.loads``).
    """

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start  # the next character to scan
        self.end = -1  # one past the closing brace, once done
        self.bad = False
        self.name: str | None = None
        self.args_start = -1  # where A starts, once its key is read
        self.args_end = -1  # one past A, once complete
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._state = "open"  # open → key → colon → value → in_value → after → key … (end set)
        self._key: str | None = None
        self._token_start = -1  # of the key or value being read
        self._kind = ""  # the value's first character, or "s" for a scalar

    @property
    def done(self) -> bool:
        return self.end >= 0

    def args_available(self) -> int:
        """One past the last character of A known now (A streams as it is written; a scalar only once whole);
        -1 while A has not started."""
        if self.args_end >= 0:
            return self.args_end
        if self.args_start >= 0 and self._state == "in_value" and self._kind != "s":
            return self.pos
        return -1

    def scan(self, text: Text) -> None:
        """Scan ``text[pos:]`` (read once: the work is the new text): sets ``name``, A's span, ``end`` or ``bad`` as
        they become known."""
        i = base = self.pos
        new = text[base:len(text)]
        while i < len(text) and not self.done and not self.bad:
            i = self._step(text, i, new[i - base])
        self.pos = i

    def valid(self, text: Text, *, needs_arguments: bool = False) -> bool:
        """The object is complete, JSON, and has a string ``name``; with ``needs_arguments``, an ``arguments`` or
        ``parameters`` key too (without markup around it, any JSON object with a ``name`` is not a call: a model
        answering in JSON writes those)."""
        if not self.done or self.bad or self.name is None:
            return False
        try:
            obj = json.loads(text[self.start:self.end])
        except (ValueError, RecursionError):
            return False
        return isinstance(obj, dict) and (not needs_arguments or any(k in obj for k in ARGS_KEYS))

    def _step(self, text: Text, i: int, c: str) -> int:
        """Consume ``c``, ``text[i]`` (or, ending a scalar, nothing); the next index."""
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._depth == 1:
                    self._end_string(text, i + 1)
            return i + 1
        state = self._state
        if state == "in_value":
            return self._step_value(text, i, c)
        if c.isspace() and state != "open":
            return i + 1
        if state == "open":
            self.bad = c != "{"
            self._depth, self._state = 1, "key"
        elif state == "key" and c == '"':
            self._in_str, self._token_start = True, i
        elif state == "key" and c == "}" and self._key is None:
            self.end = i + 1  # {}
        elif state == "colon" and c == ":":
            self._state = "value"
        elif state == "value":
            self._token_start, self._state = i, "in_value"
            if self._key in ARGS_KEYS:
                self.bad = self.args_start >= 0  # both arguments and parameters: which one is meant?
                self.args_start = i
            self._kind = c if c in '{["' else "s"
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
        elif state == "after" and c == ",":
            self._state = "key"
        elif state == "after" and c == "}":
            self.end = i + 1
        else:
            self.bad = True
        return i + 1

    def _step_value(self, text: Text, i: int, c: str) -> int:
        if self._kind == "s":
            if c in ",}" or c.isspace():
                self._end_value(text, i)
                return i  # the delimiter is the object's
            return i + 1
        if c == '"':
            self._in_str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._end_value(text, i + 1)
        return i + 1

    def _end_string(self, text: Text, end: int) -> None:
        if self._state != "key":  # a string value
            self._end_value(text, end)
            return
        try:
            self._key = json.loads(text[self._token_start:end])
        except ValueError:
            self.bad = True
        self._state = "colon"

    def _end_value(self, text: Text, end: int) -> None:
        if self._key == "name":
            try:
                name = json.loads(text[self._token_start:end])
            except ValueError:
                name = None
            if not isinstance(name, str) or not name or self.name is not None:
                self.bad = True
            else:
                self.name = name
        elif self._key in ARGS_KEYS:
            self.args_end = end
        self._state = "after"
