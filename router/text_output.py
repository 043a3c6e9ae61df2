"""`SampleText`: token ids → text deltas for one sample, with stop strings applied."""

from __future__ import annotations

from model.tokenizer import StreamDecoder, Tokenizer


class SampleText:
    """Incremental detokenizer that cuts the text at the first stop string.

    Text that could still turn out to be the start of a stop string is held back until it cannot.
    Without a tokenizer every delta is empty (the client sent token ids and reads token counts).
    """

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...]) -> None:
        self._decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self._stops = stops
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
        self._text += self._decoder.push(token_ids)
        cut = min((i for i in (self._text.find(s, max(0, self._emitted - len(s) + 1)) for s in self._stops)
                   if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._take(cut)
        return self._take(max(self._emitted, len(self._text) - self._partial_stop_len()))

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        """The held-back text, once the sample has finished without a stop string."""
        if self.stopped:
            return ""
        if self._decoder is not None:
            self._text += self._decoder.flush()
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        out = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out
