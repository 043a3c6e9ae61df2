"""Issue 28: the rates an engine measures from its own steps (what the router predicts waits from)."""

from __future__ import annotations

import pytest

from engine.step_rates import DECAY, StepRates


def test_rates_start_at_the_first_step_of_their_kind_and_decay_after():
    r = StepRates()
    assert (r.prefill_tokens_per_s, r.decode_step_s, r.decode_batch) == (0.0, 0.0, 0.0)
    r.observe(prefill_tokens=512, decode_seqs=0, seconds=0.5)
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (1024.0, 0.0)
    r.observe(prefill_tokens=256, decode_seqs=3, seconds=0.5)  # a mixed step counts as prefill
    assert r.prefill_tokens_per_s == pytest.approx((1 - DECAY) * 1024 + DECAY * 512)
    assert r.decode_step_s == 0.0
    r.observe(prefill_tokens=0, decode_seqs=8, seconds=0.02)
    r.observe(prefill_tokens=0, decode_seqs=4, seconds=0.01)
    assert r.decode_step_s == pytest.approx((1 - DECAY) * 0.02 + DECAY * 0.01)
    assert r.decode_batch == pytest.approx((1 - DECAY) * 8 + DECAY * 4)
    before = (r.prefill_tokens_per_s, r.decode_step_s)
    r.observe(prefill_tokens=4, decode_seqs=2, seconds=0.01)  # too few prompt tokens to say anything
    r.observe(prefill_tokens=0, decode_seqs=0, seconds=0.01)
    r.observe(prefill_tokens=100, decode_seqs=0, seconds=0.0)
    assert (r.prefill_tokens_per_s, r.decode_step_s) == before
