"""Issue 64: reasoning parsers (`router.reasoning`) split a chat answer's thinking from its content, whole and
streamed piece by piece, with the tags split across pieces anywhere."""

from __future__ import annotations

import pytest
from kvrelay.router.reasoning import ReasoningStream, Split, split

CASES = [  # (parser, output, reasoning, content)
    ("qwen3", "<think>Paris is in France.</think>\n\nParis.", "Paris is in France.", "\n\nParis."),
    ("qwen3", "Paris.", "", "Paris."),  # enable_thinking false: no block, all content
    ("qwen3", "<think>still thinking", "still thinking", ""),  # cut off inside the block
    ("qwen3", "<thin", "", "<thin"),  # a prefix of the tag and no more: text
    ("qwen3", "a <think>b</think> c", "", "a <think>b</think> c"),  # a block not at the start is content
    ("qwen3", "<think></think>Paris.", "", "Paris."),
    ("deepseek_r1", "The capital.</think>Paris.", "The capital.", "Paris."),  # the block opened in the prompt
    ("deepseek_r1", "<think>The capital.</think>Paris.", "The capital.", "Paris."),  # a leading tag dropped
    ("deepseek_r1", "no end tag yet", "no end tag yet", ""),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag splits
]


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), CASES)
def test_a_whole_output_splits(parser: str, output: str, reasoning: str, content: str) -> None:
    assert split(parser, output) == Split(reasoning, content)


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), CASES)
def test_streamed_in_pieces_of_every_size_it_splits_the_same(parser: str, output: str, reasoning: str,
                                                             content: str) -> None:
    """Pieces of 1, 2, 3 and 5 characters (every tag split somewhere): the pieces add up to the whole split, and no
    piece of reasoning or content contains a character of a tag the parser consumed."""
    for size in (1, 2, 3, 5):
        stream = ReasoningStream(parser)
        parts = [stream.push(output[i:i + size]) for i in range(0, len(output), size)] + [stream.flush()]
        assert Split("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == Split(
            reasoning, content), size


def test_a_tag_s_start_is_held_until_the_next_piece() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.push("<thi") == Split()
    assert stream.push("nk>abc</th") == Split("abc", "")
    assert stream.push("ink>xy") == Split("", "xy")
    assert stream.flush() == Split()


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning parser must be one of qwen3, deepseek_r1, got 'r1'"):
        ReasoningStream("r1")
