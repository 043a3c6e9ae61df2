"""Reasoning parsers (vLLM's ``--reasoning-parser``): a chat answer's thinking apart from its content.

Reasoning models write their thinking between ``<think>`` and ``</think>`` before the answer. With a parser set
(``router.reasoning_parser``), a chat choice's ``message.reasoning_content`` carries the thinking and
``message.content`` the rest; streamed, the thinking goes out as ``delta.reasoning_content`` and the answer as
``delta.content`` (tool calls are then found in the content only). Completions are not split.

* ``qwen3``: the thinking is what lies between a ``<think>`` at the start of the output and the first ``</think>``;
  output that does not start with ``<think>`` is all content (Qwen3 with ``enable_thinking: false``, whose template
  puts an empty think block in the prompt). Output cut off inside the block is all reasoning.
* ``deepseek_r1``: DeepSeek-R1's template opens the block in the prompt, so the output starts inside it: everything
  up to the first ``</think>`` is thinking (a leading ``<think>`` dropped), the rest content; output with no
  ``</think>`` is all reasoning.

Streaming splits the same way piece by piece: a piece that ends with the start of a tag is held back until the
next piece says whether the tag is there, so a tag split across tokens is never sent as text.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class Split:
    """One piece of output, split: ``reasoning`` and ``content`` (either may be empty)."""

    reasoning: str = ""
    content: str = ""


def split(parser: str, text: str) -> Split:
    """The whole output ``text`` of one choice, split by ``parser`` (`REASONING_PARSERS`; see module doc).

    Raises:
        ValueError: an unknown parser.
    """
    stream = ReasoningStream(parser)
    return stream.push(text, final=True)


class ReasoningStream:
    """A streamed choice's split, piece by piece (see module doc): `push` each piece of text, `flush` at the end.

    Raises:
        ValueError: an unknown parser (at construction).
    """

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self.parser = parser
        # "start": nothing decided yet; "think": inside the block; "content": after it (or no block at all)
        self.state = "think" if parser == "deepseek_r1" else "start"
        self.held = ""  # text held back: a possible tag's first characters, or (at the start) a possible <think>
        self.at_start = True  # deepseek_r1: a leading <think> is dropped

    def push(self, piece: str, *, final: bool = False) -> Split:
        """What ``piece`` adds, split; text that might begin a tag is held for the next call, or with ``final`` (the
        output's last piece) given out as what it is (`flush`)."""
        if final:
            first, last = self._push(piece), self.flush()
            return Split(first.reasoning + last.reasoning, first.content + last.content)
        return self._push(piece)

    def _push(self, piece: str) -> Split:
        text, self.held = self.held + piece, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.state == "start" or (self.state == "think" and self.at_start):
                if len(text) < len(THINK_START) and THINK_START.startswith(text):
                    self.held = text  # could still become <think>
                    break
                self.at_start = False
                if text.startswith(THINK_START):
                    text = text[len(THINK_START):]
                    self.state = "think"
                else:
                    self.state = "think" if self.state == "think" else "content"
                continue
            if self.state == "content":
                content.append(text)
                break
            end = text.find(THINK_END)
            if end >= 0:
                reasoning.append(text[:end])
                text = text[end + len(THINK_END):]
                self.state = "content"
                continue
            keep = _partial_suffix(text, THINK_END)
            reasoning.append(text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return Split("".join(reasoning), "".join(content))

    def flush(self) -> Split:
        """The end of the output: what was held back, as the state it is in."""
        held, self.held = self.held, ""
        if not held:
            return Split()
        if self.state == "start":  # the output was a prefix of <think> and no more: not a block
            return Split(content=held)
        return Split(reasoning=held) if self.state == "think" else Split(content=held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
