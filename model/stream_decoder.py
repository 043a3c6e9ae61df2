"""`stream_decoder`: one sample's token ids → text deltas, in work linear in the ids whatever they are.

Contract: the deltas `push` returns, joined, plus `flush`, equal ``tokenizer.decode(all ids)``. A push
works on its own ids plus a few held back or kept as context, never on everything since the last
complete character; text is held back only while it can still change. Two ways, by decoder:

* GPT-2's ByteLevel (Llama 3, Qwen, SmolLM2, gpt-oss, the tiny model): `ByteStreamDecoder`. There
  ``decode`` is the ids' bytes (`Tokenizer.token_bytes`) joined, as UTF-8 with each ill-formed part
  U+FFFD (maximal subparts, as Rust's ``from_utf8_lossy`` and Python's ``errors="replace"`` both
  render it), so Python's incremental UTF-8 decoder gives it exactly: it holds back only the ≤ 3 bytes
  of a character that can still complete, and a byte that cannot (a continuation byte with no lead)
  comes out as U+FFFD at once. Exact for any ids.
* any other decoder (SentencePiece: ``▁`` → space, byte fallback ``<0xE6>``, a stripped leading space;
  WordPiece; none): `WindowStreamDecoder`. It decodes the ids not yet sent after the previous delta's
  ids (context, so pieces that depend on their neighbours come out right) and sends what is new;
  while that ends in U+FFFD it sends up to the last id whose text ends clean and holds back at most
  `MAX_HELD_IDS` ids, then sends them as decoded: a character is at most 4 bytes, so they cannot
  complete one. Exact for any ids in which each run of byte-fallback tokens is well-formed UTF-8 (what
  a model writes for a character it has no token for). Byte fallback renders an ill-formed run as one
  U+FFFD per byte, the run's well-formed characters included; characters of such a run sent before
  the run went wrong stay sent, and the bytes after them decode on their own, so only there do the
  deltas differ from ``decode``::

      ids     <0xE6> <0x97> <0xA5> <0xFF> b
      deltas  ""     ""     "日"   ""     "\\ufffdb"      decode(all): "\\ufffd\\ufffd\\ufffd\\ufffdb"
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

from kvrelay.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
MAX_HELD_IDS = 3  # a UTF-8 character is at most 4 bytes: at most 3 byte tokens wait for the one that ends it


class StreamDecoder(Protocol):
    """Text deltas of a growing list of ids (see the module doc for the contract)."""

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; the text that is now final (possibly empty)."""
        ...

    def flush(self) -> str:
        """The text still held back, as ``decode`` renders it at the end (an incomplete character is
        U+FFFD); later pushes start afresh."""
        ...


def stream_decoder(tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> StreamDecoder:
    """The stream decoder that fits ``tokenizer``'s decoder (module doc)."""
    kind = ByteStreamDecoder if tokenizer.byte_level else WindowStreamDecoder
    return kind(tokenizer, skip_special_tokens=skip_special_tokens)


class ByteStreamDecoder:
    """For a `Tokenizer.byte_level` tokenizer: the ids' bytes through an incremental UTF-8 decoder.
    A push costs one `token_bytes` lookup per id and the UTF-8 decoding of its bytes."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, new_ids: Sequence[int]) -> str:
        token_bytes = self._tokenizer.token_bytes
        return self._utf8.decode(b"".join(token_bytes(i) for i in new_ids if i not in self._skipped))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)  # final also resets the decoder


class WindowStreamDecoder:
    """For any tokenizer: ``decode`` over a window of the previous delta's ids and the ids not yet sent.

    Each push decodes the window at most ``2 * (MAX_HELD_IDS + 1) + 1`` times; the window holds the previous
    delta's ids, at most `MAX_HELD_IDS` ids held back, and the new ones::

        _ids:  [ context: sent with the previous delta | held back | new ]
                 decodes to _context                   ^ _num_context
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # decode leaves skipped special ids and ids it does not know out before its decoder runs, so
        # the window does too (a context of them alone would decode to nothing)
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._num_context = 0
        self._context = ""

    def push(self, new_ids: Sequence[int]) -> str:
        known = self._tokenizer.vocab_size
        self._ids.extend(i for i in new_ids if i < known and i not in self._skipped)
        end = len(self._ids)
        if end == self._num_context:  # nothing decode would see: keep the context as it is
            return ""
        text = self._new_text(end)
        if not text.endswith(REPLACEMENT):
            return self._send(end, text)
        for cut in range(end - 1, max(self._num_context, end - MAX_HELD_IDS - 1), -1):
            head = self._new_text(cut)
            if not head.endswith(REPLACEMENT):
                return self._send(cut, head)
        return "" if end - self._num_context <= MAX_HELD_IDS else self._send(end, text)

    def flush(self) -> str:
        text = self._new_text(len(self._ids))
        self._ids, self._num_context, self._context = [], 0, ""
        return text

    def _new_text(self, end: int) -> str:
        """The text ``_ids[_num_context:end]`` add after the context."""
        text = self._tokenizer.decode(self._ids[:end], self._skip)
        if text.startswith(self._context):
            return text[len(self._context):]
        # The context renders otherwise now (a byte-fallback run went ill-formed): it was sent as it
        # was, so the ids after it decode on their own.
        return self._tokenizer.decode(self._ids[self._num_context:end], self._skip)

    def _send(self, cut: int, text: str) -> str:
        """Return ``text`` (that of the ids up to ``cut``) and make those ids the next context."""
        del self._ids[: self._num_context]
        self._num_context = cut - self._num_context
        self._context = self._tokenizer.decode(self._ids[: self._num_context], self._skip)
        return text
