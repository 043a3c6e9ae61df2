"""`StepRates`: how fast this engine computes, measured from its own steps (decayed averages).

A router predicts waits from them (queued prompt tokens over the prefill rate, queued output tokens over
the decode rate) and a node reports them in its event answers; nothing here is configured by hand.

    step with prefill tokens   →  prefill_tokens_per_s ← decayed (prefill tokens / step seconds)
    decode-only step           →  decode_step_s        ← decayed (step seconds), decode_batch ← (sequences)

A step that mixes prefill and decode counts as prefill (its decode rows ride along), so the prefill rate is
a lower bound. ``DECAY`` weighs the newest step; the first observation sets the average.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.1  # weight of the newest step in each average
MIN_PREFILL_TOKENS = 16  # a step computing fewer prompt tokens says little about the prefill rate


@dataclass(slots=True)
class StepRates:
    """Decayed step figures; 0.0 until the first step of the kind. Written by the engine's thread only
    (plain floats: any thread may read a snapshot)."""

    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    decode_batch: float = 0.0

    def observe(self, *, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """Fold in one step that computed ``prefill_tokens`` prompt tokens and ``decode_seqs`` decode rows in
        ``seconds`` (wall time of the forward and sampling)."""
        if seconds <= 0:
            return
        if prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_tokens_per_s = _decayed(self.prefill_tokens_per_s, prefill_tokens / seconds)
        elif prefill_tokens == 0 and decode_seqs > 0:
            self.decode_step_s = _decayed(self.decode_step_s, seconds)
            self.decode_batch = _decayed(self.decode_batch, float(decode_seqs))


def _decayed(average: float, sample: float) -> float:
    return sample if average == 0.0 else (1 - DECAY) * average + DECAY * sample
