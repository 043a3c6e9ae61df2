"""`SampleText`: token ids → text deltas for one sample, with stop strings applied."""

from __future__ import annotations

from kvrelay.model.stream_decoder import stream_decoder
from kvrelay.model.tokenizer import Tokenizer


class StopScanner:
    """Finds the first stop string in text fed piece by piece, in time linear in the text: one KMP
    automaton per stop string, so nothing is ever rescanned however long the output or the stop strings
    (`feed` costs O(len(text) · len(stops)) amortized; construction O(total stop length))."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._fail = [_failure_table(s) for s in stops]
        self._state = [0] * len(stops)  # per stop: the longest prefix of it that the text ends with
        self._fed = 0
        self.matched_chars = 0  # the length of the stop string `feed` found

    def feed(self, text: str) -> int:
        """Scan ``text`` (what follows everything fed so far); the index, counted from the start of all
        the text fed, where the first stop string to complete begins, or -1."""
        if not self._stops:
            self._fed += len(text)
            return -1
        stops, fail, state = self._stops, self._fail, self._state
        for ch in text:
            self._fed += 1
            for i, stop in enumerate(stops):
                k = state[i]
                while k and stop[k] != ch:
                    k = fail[i][k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    self.matched_chars = k
                    return self._fed - k
                state[i] = k
        return -1

    @property
    def partial(self) -> int:
        """Length of the longest suffix of the text fed that is a proper prefix of a stop string."""
        return max(self._state, default=0)


def _failure_table(pattern: str) -> list[int]:
    """KMP: ``table[i]`` is the length of the longest proper prefix of ``pattern[:i+1]`` that is also its suffix."""
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table


class SampleText:
    """Incremental detokenizer that cuts the text at the first stop string.

    Text that could still turn out to be the start of a stop string is held back until it cannot.
    Without a tokenizer every delta is empty (the client sent token ids and reads token counts).
    Special tokens are left out of the text (unless ``skip_special_tokens`` is false: vLLM's field), except
    ``keep_special_ids`` (a tool-call parser's markup that the tokenizer makes special tokens, e.g. Mistral's
    ``[TOOL_CALLS]``). ``include_stop``: the stop string that ends the text stays in it (vLLM's
    ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...], *,
                 keep_special_ids: frozenset[int] = frozenset(), skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        self._decoder = None
        self._dropped: frozenset[int] = frozenset()  # ids left out before decoding (all specials but the kept)
        if tokenizer is not None:
            keep = bool(keep_special_ids)
            self._decoder = stream_decoder(tokenizer, skip_special_tokens=skip_special_tokens and not keep)
            self._dropped = tokenizer.special_ids - keep_special_ids if keep and skip_special_tokens else frozenset()
        self._include_stop = include_stop
        self._scanner = StopScanner(stops)
        self._text = ""
        self._emitted = 0
        self.stopped = False
        self.num_tokens = 0

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send. Sets ``stopped`` on a stop string."""
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        if self._decoder is None:
            return ""
        if self._dropped:
            token_ids = [t for t in token_ids if t not in self._dropped]
        return self._add(self._decoder.push(token_ids))

    def flush(self) -> str:
        """The held-back text, once the sample has finished without a stop string (the decoder's last
        bytes may still complete one)."""
        if self.stopped:
            return ""
        out = self._add(self._decoder.flush()) if self._decoder is not None else ""
        return out if self.stopped else out + self._take(len(self._text))

    def _add(self, delta: str) -> str:
        self._text += delta
        cut = self._scanner.feed(delta)
        if cut >= 0:
            self.stopped = True
            return self._take(cut + (self._scanner.matched_chars if self._include_stop else 0))
        return self._take(len(self._text) - self._scanner.partial)

    def _take(self, end: int) -> str:
        out = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out
