"""Tool calls in a chat choice's text: the parsers, by vLLM's names (`PARSER_NAMES`), and the state machine that
turns text arriving piece by piece into content and call deltas (`ToolStream`).

The whole text of a non-streamed choice goes through the same machine (`ToolOutput.parse`), so the deltas of a
stream, joined, equal the calls of the same answer not streamed. What each format looks like (``ws``: optional
whitespace; ``A``: the arguments, any JSON value; a call's ``arguments`` is A's text exactly as the model wrote it)::

    hermes       content <tool_call> ws {"name": N, "arguments": A} ws </tool_call> ...   (text between calls: dropped)
    llama3_json  ws [<|python_tag|>] ws {"name": N, "parameters": A} ws [; {...}] ...   (else all content)
    mistral      content [TOOL_CALLS] ws [{"name": N, "arguments": A}, ...]
    required     ws [{"name": N, "parameters": A}, ...]     tool_choice "required" (a JSON schema forces this shape)
    named        A                                          tool_choice names the function: the text is A

Either key, ``arguments`` or ``parameters``, names A in every format; a call without one has ``{}``. A choice
whose calls do not parse (malformed JSON, a call cut off by max_tokens) is all content, as vLLM answers it; a
stream cannot take back the call deltas it already sent, so there they stand. Streams hold back only what may
still turn out to be markup (the start of ``<tool_call>``; llama3_json's first object until it has a name).

A piece costs its own length and the open call's, never the text or the calls before it: the text is a
`GrowingText` (read by slices), the framing scans each character once, and calls that can send nothing more are
not visited again (``calls_visited`` counts the visits; tests bound it, with ``text.chars_read``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.router.call_scanner import CallScanner, partial_overlap
from kvrelay.router.growing_text import GrowingText

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARK = "[TOOL_CALLS]"
# When --tool-call-parser is not given: what the chat template writes, else the model family (config.json).
MODEL_TYPE_TO_PARSER = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes", "llama": "llama3_json",
                        "mistral": "mistral", "mixtral": "mistral"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call. ``arguments``: JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A choice's text split into content (None: none) and calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


@dataclass(slots=True)
class CallDelta:
    """New text of call ``index``: its first delta carries ``id`` and ``name``; ``arguments`` continue it."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class StreamDelta:
    """What one piece of text added: content and call deltas (at most one per call)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def then(self, later: StreamDelta) -> StreamDelta:
        """This delta and a ``later`` one as one (a call's later pieces joined onto its delta here)."""
        index_to_call = {c.index: CallDelta(c.index, c.id, c.name, c.arguments) for c in self.calls}
        for c in later.calls:
            if c.index in index_to_call:
                index_to_call[c.index].arguments += c.arguments
            else:
                index_to_call[c.index] = c
        return StreamDelta(self.content + later.content, list(index_to_call.values()))


@dataclass(slots=True)
class _Call:
    id: str
    scanner: CallScanner
    header_sent: bool = False
    args_sent: int = 0  # characters of A sent
    default_sent: bool = False  # "{}" sent for a call without arguments


class ToolStream:
    """One choice's text → content and call deltas (`feed`, then `finish`), and at the end the whole answer
    (`result`). Subclasses frame the calls (`_advance`: moves ``content_end``, starts and scans calls, sets
    ``failed``); this class sends what they found. One per choice; not thread-safe.
    """

    NEEDS_ARGUMENTS = False  # a call must carry an arguments (or parameters) key (`CallScanner.valid`)

    def __init__(self) -> None:
        self.text = GrowingText()
        self.content_end = 0  # content is text[:content_end], as far as it is known
        self.failed = False  # the calls do not parse: the answer is all content
        self.calls: list[_Call] = []
        self.calls_visited = 0  # calls `_collect` looked at, all pieces together
        self._settled = 0  # calls[:_settled] have sent all they will (their scan ended): `_collect` skips them
        self._any_header_sent = False
        self._content_sent = 0
        self._pos = 0  # the framing's position in text
        self._finished = False

    def feed(self, text: str) -> StreamDelta:
        self.text.append(text)
        self._advance(final=False)
        return self._collect()

    def finish(self) -> StreamDelta:
        """The rest, once the choice's text is complete."""
        self._finished = True
        self._advance(final=True)
        if self.calls and not self.failed and not self._all_valid():
            self.failed = True  # as `result` decides: then the answer is all content
        return self._collect()

    def _all_valid(self) -> bool:
        return all(c.scanner.valid(self.text, needs_arguments=self.NEEDS_ARGUMENTS) for c in self.calls)

    def result(self) -> ParsedOutput:
        """The whole answer (after `finish`): the calls and the content before them, or all content when there
        are none or they do not parse."""
        assert self._finished, "result() needs finish()"
        calls = tuple(ToolCall(c.id, c.scanner.name or "", self._args(c)) for c in self.calls)
        if not calls or self.failed or not self._all_valid():
            return ParsedOutput(str(self.text), ())
        return ParsedOutput(self.text[:self.content_end] or None, calls)

    def _args(self, call: _Call) -> str:
        s = call.scanner
        return self.text[s.args_start:s.args_end] if s.args_end >= 0 else "{}"

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _clear_calls(self) -> None:
        """Forget the calls found (none of them sent anything): the text is content after all."""
        assert not self._any_header_sent
        self.calls.clear()
        self._settled = 0

    def _collect(self) -> StreamDelta:
        if self.failed and not self._any_header_sent:
            self.content_end = len(self.text)  # no call after all: the rest is content, as `result` gives it
        out = StreamDelta(self.text[self._content_sent:self.content_end])
        self._content_sent = max(self._content_sent, self.content_end)
        if self.failed:
            return out  # no call sends anything more
        for index in range(self._settled, len(self.calls)):
            call = self.calls[index]
            s = call.scanner
            self.calls_visited += 1
            if (s.done or s.bad) and index == self._settled:
                self._settled += 1  # what it has left to send is sent below, now
            if s.bad or s.name is None or (self.NEEDS_ARGUMENTS and s.args_start < 0):
                continue  # (a header waits, where it must, for the arguments: else it may be no call at all)
            delta = CallDelta(index, None, None, "")
            if not call.header_sent:
                call.header_sent = self._any_header_sent = True
                delta.id, delta.name = call.id, s.name
            upto = s.args_available()
            if upto >= 0:
                delta.arguments = self.text[s.args_start + call.args_sent:upto]
                call.args_sent = upto - s.args_start
            elif s.done and not call.default_sent:
                call.default_sent = True
                delta.arguments = "{}"
            if delta.id is not None or delta.arguments:
                out.calls.append(delta)
        return out

    # ---------------------------------------------------------------- for the framings
    def _skip_ws(self) -> bool:
        """Move past whitespace; whether a character follows."""
        text, p = self.text, self._pos
        while p < len(text) and text[p].isspace():
            p += 1
        self._pos = p
        return p < len(text)

    def _start_call(self) -> None:
        self.calls.append(_Call(new_call_id(), CallScanner(self._pos)))

    def _scan_call(self) -> CallScanner:
        """The last call's scanner, fed the text so far."""
        s = self.calls[-1].scanner
        s.scan(self.text)
        return s

    def _content_until(self, mark: str, final: bool) -> bool:
        """Content up to ``mark`` (holding back what may still become it); whether ``mark`` was found (the
        position is then past it)."""
        i = self.text.find(mark, self._pos)
        if i >= 0:
            self.content_end, self._pos = i, i + len(mark)
            return True
        end = len(self.text)
        tail = self.text[max(0, end - len(mark) + 1):end]
        self.content_end = end if final else end - partial_overlap(tail, mark)
        self._pos = max(self._pos, end - len(mark) + 1)
        return False


class HermesStream(ToolStream):
    """Qwen2 / 2.5 / 3, Hermes, SmolLM2: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, several."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "content"

    def _advance(self, final: bool) -> None:
        while not self.failed:
            state = self._state
            if state == "content":
                if not self._content_until(HERMES_OPEN, final):
                    return
                self._state = "open"
            elif state == "between":  # text after a call, before the next: dropped
                i = self.text.find(HERMES_OPEN, self._pos)
                if i < 0:
                    self._pos = max(self._pos, len(self.text) - len(HERMES_OPEN) + 1)
                    return
                self._pos, self._state = i + len(HERMES_OPEN), "open"
            elif state == "open":
                if not self._skip_ws():
                    self.failed = final  # "<tool_call>" and nothing after it
                    return
                if self.text[self._pos] != "{":
                    self.failed = True
                    return
                self._start_call()
                self._state = "call"
            elif state == "call":
                s = self._scan_call()
                self.failed = s.bad
                if not s.done:
                    return
                self._pos, self._state = s.end, "close"
            else:  # close: "</tool_call>"; a call the text ends in, or ends within this tag, stands
                if not self._skip_ws():
                    return
                rest = self.text[self._pos:self._pos + len(HERMES_CLOSE)]
                if rest == HERMES_CLOSE:
                    self._pos += len(HERMES_CLOSE)
                    self._state = "between"
                elif HERMES_CLOSE.startswith(rest):
                    return
                else:
                    self.failed = True


class ArrayStream(ToolStream):
    """``[{"name": ..., "parameters": ...}, ...]``: the whole text (tool_choice "required"), or what follows
    ``mark`` (Mistral: content ``[TOOL_CALLS][...]``). Text after the closing bracket is dropped."""

    def __init__(self, mark: str | None = None) -> None:
        super().__init__()
        self._mark = mark
        self._state = "content" if mark else "open"

    def _advance(self, final: bool) -> None:
        while not self.failed:
            state = self._state
            if state == "content":
                assert self._mark is not None
                if not self._content_until(self._mark, final):
                    return
                self._state = "open"
            elif state == "done":
                return
            elif state == "call":
                s = self._scan_call()
                self.failed = s.bad
                if not s.done:
                    break
                self._pos, self._state = s.end, "sep"
            else:
                if not self._skip_ws():
                    break
                c = self.text[self._pos]
                if c not in {"open": "[", "item": "{]", "next_item": "{", "sep": ",]"}[state]:
                    self.failed = True
                    return
                if c == "{":
                    self._start_call()
                    self._state = "call"
                else:
                    self._pos += 1
                    self._state = {"[": "item", ",": "next_item", "]": "done"}[c]
        if final and self._state != "done":
            self.failed = True  # the array is not complete


class MistralStream(ArrayStream):
    """Mistral (v3 tokenizers and later): ``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``."""

    def __init__(self) -> None:
        super().__init__(MISTRAL_MARK)


class Llama3JsonStream(ToolStream):
    """Llama 3.x: an optional ``<|python_tag|>``, then ``{"name": ..., "parameters": ...}`` objects separated by
    ``;``. A text that does not start so, or whose first object has no name or no arguments key, is all
    content; text after the calls is dropped."""

    NEEDS_ARGUMENTS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = "lead"

    def _advance(self, final: bool) -> None:
        while not self.failed:
            state = self._state
            if state == "content":
                self.content_end = len(self.text)
                return
            if state == "ignore":
                return
            if state != "call" and not self._skip_ws():
                break
            if state == "lead":
                rest = self.text[self._pos:self._pos + len(PYTHON_TAG)]
                if rest == PYTHON_TAG:
                    self._pos += len(PYTHON_TAG)
                elif PYTHON_TAG.startswith(rest):
                    break
                elif rest[0] != "{":
                    self._state = "content"
                    continue
                self._state = "object"
            elif state == "object":
                if self.text[self._pos] != "{":
                    self._state = "ignore" if self.calls else "content"
                    continue
                self._start_call()
                self._state = "call"
            elif state == "call":
                s = self._scan_call()
                if (s.bad or (s.done and s.name is None)) and self._first_unsent():
                    self._clear_calls()
                    self._state = "content"  # not a call: the object is the answer
                    continue
                self.failed = s.bad
                if not s.done:
                    break
                self._pos, self._state = s.end, "sep"
            else:  # sep: ";" or the next object
                c = self.text[self._pos]
                if c == ";":
                    self._pos += 1
                self._state = "object" if c in ";{" else "ignore"
        if final and not self.failed and ((self._state in ("lead", "object") and not self.calls)
                                          or (self._state == "call" and self._first_unsent())):
            self._clear_calls()  # only whitespace, a tag, or an object cut off before its name: content
            self._state = "content"
            self.content_end = len(self.text)

    def _first_unsent(self) -> bool:
        return len(self.calls) == 1 and not self.calls[0].header_sent


class NamedStream(ToolStream):
    """tool_choice names the function: the whole text is its arguments (a JSON schema forces them)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._id = new_call_id()
        self._header_sent = False
        self._sent = 0  # characters of the text sent as arguments

    def feed(self, text: str) -> StreamDelta:
        self.text.append(text)
        return self._delta(final=False)

    def finish(self) -> StreamDelta:
        self._finished = True
        return self._delta(final=True)

    def result(self) -> ParsedOutput:
        assert self._finished, "result() needs finish()"
        return ParsedOutput(None, (ToolCall(self._id, self._name, str(self.text)),))

    def _delta(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        if not self._header_sent:
            if not self.text and not final:
                return out
            self._header_sent = True
            out.calls.append(CallDelta(0, self._id, self._name, self.text[0:]))
        elif len(self.text) > self._sent:
            out.calls.append(CallDelta(0, None, None, self.text[self._sent:]))
        self._sent = len(self.text)
        return out


PARSER_NAME_TO_STREAM: dict[str, type[ToolStream]] = {
    "hermes": HermesStream, "llama3_json": Llama3JsonStream, "mistral": MistralStream,
}
PARSER_NAMES = tuple(PARSER_NAME_TO_STREAM)
# Markup that some tokenizers make one special token (kept in the text for the parser: `ToolOutput.keep_token_ids`)
PARSER_NAME_TO_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": (HERMES_OPEN, HERMES_CLOSE), "llama3_json": (PYTHON_TAG,), "mistral": (MISTRAL_MARK,),
}


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """How a chat choice's text becomes tool calls.

    ``mode``: ``auto`` (``parser`` finds calls in free text), ``required`` (a JSON array of calls, forced by a
    schema) or ``named`` (the text is the arguments of ``name``, forced by its schema). ``keep_token_ids``: special
    tokens the parser's markup is made of, kept in the text (``[TOOL_CALLS]`` of Mistral's tokenizers).

    Raises:
        ValueError: an unknown mode or parser.
    """

    mode: str
    parser: str = ""
    name: str = ""
    keep_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "required", "named"):
            raise ValueError(f"tool output mode must be auto, required or named, got {self.mode!r}")
        if self.mode == "auto" and self.parser not in PARSER_NAME_TO_STREAM:
            raise ValueError(f"unknown tool-call parser {self.parser!r}; use one of {', '.join(PARSER_NAMES)}")

    def stream(self) -> ToolStream:
        if self.mode == "named":
            return NamedStream(self.name)
        if self.mode == "required":
            return ArrayStream()
        return PARSER_NAME_TO_STREAM[self.parser]()

    def parse(self, text: str) -> ParsedOutput:
        """The whole answer: what a stream of ``text`` ends with."""
        stream = self.stream()
        stream.feed(text)
        stream.finish()
        return stream.result()

    def finish_reason(self, parsed: ParsedOutput, reason: str) -> str:
        """OpenAI's (and vLLM's): ``tool_calls`` for calls ``auto`` found or ``required`` forced (ending at a
        stop); a named function's call, and an answer without calls, keep ``reason``."""
        if parsed.calls and (self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason


def default_parser(model_dir: str | Path, chat_template: str | None) -> str | None:
    """The parser for a model when none is configured: the one its chat template's markup names, else its family's
    (``config.json``'s ``model_type``); None when neither says (gpt-oss's harmony format has no parser here)."""
    template = chat_template or ""
    if HERMES_OPEN in template or "<|im_start|>" in template:
        return "hermes"  # Qwen2 / 2.5 / 3, and Llama-architecture models with ChatML (SmolLM2)
    if PYTHON_TAG in template or "<|start_header_id|>" in template:
        return "llama3_json"
    if MISTRAL_MARK in template or "[INST]" in template:
        return "mistral"
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return MODEL_TYPE_TO_PARSER.get(model_type) if isinstance(model_type, str) else None
