"""A gpt-oss chat choice's output tokens → reasoning, content and tool calls (harmony's ``StreamableParser``).

Each generated token goes through the parser; the text it adds goes where its message's channel says::

    analysis                               → reasoning_content
    final (or no channel)                  → content
    commentary, no recipient (a preamble)  → content
    recipient functions.NAME               → a tool call NAME, the message its arguments (when calls are parsed:
                                             tools given with tool_choice auto; else reasoning)
    any other recipient (browser, python)  → reasoning (built-in tools are not served)

A second message on the same side (a second analysis message, a second final one) is set off by ``\\n``. The whole
output of a non-streamed choice goes through the same machine (`parse_tokens`), so a stream's deltas joined equal
the answer not streamed. Tokens the parser refuses (output that is not harmony) and everything after them are
decoded and given as content, so no output is lost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvrelay.router.tool_calls import CallDelta, ToolCall
from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamableParser

FUNCTIONS = "functions."


@dataclass(slots=True)
class HarmonyDelta:
    """What some tokens added: reasoning text, content text and tool-call deltas (a call's first carries its id
    and name)."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class HarmonyResult:
    """A whole choice: ``reasoning`` and ``content`` (None: none), its ``calls``."""

    reasoning: str | None
    content: str | None
    calls: tuple[ToolCall, ...]


class HarmonyStream:
    """One choice's tokens → deltas (`push`), and the whole answer so far (`result`). ``calls``: function calls
    become tool calls (else reasoning). Not thread-safe."""

    def __init__(self, encoding: HarmonyEncoding, *, calls: bool) -> None:
        self._encoding = encoding
        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self._calls = calls
        self._broken = False  # the parser refused a token: the rest is decoded as content
        self._message = -1  # the index (in parser.messages) of the message being sent
        self._side = ""  # where that message goes: reasoning, content or call
        self._sides_used: set[str] = set()
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._call_names: list[str] = []
        self._call_ids: list[str] = []
        self._call_args: list[list[str]] = []

    def push(self, token_ids: list[int]) -> HarmonyDelta:
        """Feed generated tokens; what they add."""
        out = HarmonyDelta()
        for pos, tok in enumerate(token_ids):
            if self._broken:
                self._add(out, "content", self._encoding.decode(token_ids[pos:]))
                break
            try:
                self._parser.process(tok)
            except HarmonyError:
                self._broken = True
                self._add(out, "content", self._encoding.decode(token_ids[pos:]))
                break
            delta = self._parser.last_content_delta
            if delta:
                self._route(out, delta)
        return out

    def _route(self, out: HarmonyDelta, delta: str) -> None:
        index = len(self._parser.messages)  # the message in progress comes after the finished ones
        if index != self._message:
            self._message = index
            self._side = self._side_of(self._parser.current_channel, self._parser.current_recipient)
            if self._side == "call":
                name = (self._parser.current_recipient or "")[len(FUNCTIONS):]
                self._call_names.append(name)
                self._call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self._call_args.append([])
                out.calls.append(CallDelta(len(self._call_ids) - 1, self._call_ids[-1], name, ""))
            elif self._side in self._sides_used:
                self._add(out, self._side, "\n")
            self._sides_used.add(self._side)
        self._add(out, self._side, delta)

    def _side_of(self, channel: str | None, recipient: str | None) -> str:
        if recipient:
            return "call" if recipient.startswith(FUNCTIONS) and self._calls else "reasoning"
        return "reasoning" if channel == "analysis" else "content"

    def _add(self, out: HarmonyDelta, side: str, text: str) -> None:
        if side == "reasoning":
            out.reasoning += text
            self._reasoning.append(text)
        elif side == "content":
            out.content += text
            self._content.append(text)
        else:
            index = len(self._call_ids) - 1
            self._call_args[index].append(text)
            if out.calls and out.calls[-1].index == index:
                out.calls[-1].arguments += text
            else:
                out.calls.append(CallDelta(index, None, None, text))

    def result(self) -> HarmonyResult:
        """Everything pushed so far, whole (a call's arguments are its message's text, as the model wrote it)."""
        calls = tuple(ToolCall(i, n, "".join(a)) for i, n, a in zip(self._call_ids, self._call_names,
                                                                    self._call_args, strict=True))
        return HarmonyResult("".join(self._reasoning) or None, "".join(self._content) or None, calls)


def parse_tokens(encoding: HarmonyEncoding, token_ids: list[int], *, calls: bool) -> HarmonyResult:
    """A whole choice's tokens, parsed as `HarmonyStream` parses them."""
    stream = HarmonyStream(encoding, calls=calls)
    stream.push(token_ids)
    return stream.result()
