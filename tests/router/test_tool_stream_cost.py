"""A tool-call stream's work grows with its text, not with text × calls (gap E of the 2026-12-07 edges notes: each
piece walked every call so far and copied the whole text, O(calls × pieces) on the router's event loop).

Work is counted, not timed: the Python function calls the router's modules make while the pieces are fed (a
profile hook: deterministic), the characters the text hands out (`GrowingText.chars_read`) and the calls
`_collect` visits (`ToolStream.calls_visited`). Fed the same call k times, each count is a + b·k exactly.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest
from kvrelay.router.growing_text import GrowingText
from kvrelay.router.tool_calls import ToolOutput, ToolStream

HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"q": [1, 2]}}\n</tool_call>\n'
CASES = [  # (output, text before the calls, one call (or a part of one), text after them, calls parsed - k)
    (ToolOutput("auto", "hermes"), "Let me see. ", HERMES_CALL, "", 0),
    (ToolOutput("auto", "llama3_json"), "<|python_tag|>", '{"name": "f", "parameters": {"q": 1}}; ',
     '{"name": "g", "parameters": {}}', 1),
    (ToolOutput("auto", "mistral"), "Sure. [TOOL_CALLS][", '{"name": "f", "arguments": {"q": "x"}}, ',
     '{"name": "g"}]', 1),
    (ToolOutput("required"), "[", '{"name": "f", "parameters": {}}, ', '{"name": "g", "parameters": {}}]', 1),
    (ToolOutput("auto", "hermes"), '<tool_call>\n{"name": "f", "arguments": [', '"a long argument", ', '0]}', None),
    (ToolOutput("named", name="f"), '{"q": [', '"a long argument", ', '0]}', None),  # None: one call, k parts
]


def _work(stream: ToolStream, pieces: list[str]) -> tuple[int, int, int]:
    """Python calls into kvrelay.router while ``pieces`` are fed, characters read, calls visited."""
    counted = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal counted
        if event == "call" and frame.f_globals.get("__name__", "").startswith("kvrelay.router"):
            counted += 1

    sys.setprofile(profile)
    try:
        for piece in pieces:
            stream.feed(piece)
    finally:
        sys.setprofile(None)
    return counted, getattr(stream.text, "chars_read", -1), getattr(stream, "calls_visited", -1)


def _split(text: str) -> list[str]:
    return [text[i:i + 3] for i in range(0, len(text), 3)]


@pytest.mark.parametrize(("output", "head", "call", "tail", "more_calls"), CASES)
def test_feeding_k_calls_costs_a_plus_b_k(output, head, call, tail, more_calls):
    works = []
    for k in (50, 100, 150):
        pieces = _split(head) + _split(call) * k + _split(tail)  # every call split the same way
        stream = output.stream()
        works.append(_work(stream, pieces))
        stream.finish()
        assert len(stream.result().calls) == (1 if more_calls is None else k + more_calls)
    (calls_50, chars_50, visits_50), (calls_100, chars_100, visits_100), (calls_150, chars_150, visits_150) = works
    assert calls_150 - calls_100 == calls_100 - calls_50  # was quadratic: every call walked on every piece
    assert chars_150 - chars_100 == chars_100 - chars_50
    assert visits_150 - visits_100 == visits_100 - visits_50
    assert chars_150 <= 3 * len(head + call * 150 + tail)


def test_growing_text_reads_by_absolute_position():
    text = GrowingText()
    for piece in ("ab", "", "cde", "f"):
        text.append(piece)
    assert (len(text), text[0], text[2], text[5], text[1:4], text[4:], text[:0], text[3:99]) == \
        (6, "a", "c", "f", "bcd", "ef", "", "def")
    assert (text.find("de", 0), text.find("de", 4), text.find("f", 5)) == (3, -1, 5)
    assert str(text) == "abcdef"
    text.append("g")
    assert (str(text), text[5:7]) == ("abcdefg", "fg")
    with pytest.raises(IndexError):
        text[7]
