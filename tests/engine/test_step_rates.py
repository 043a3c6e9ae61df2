"""Issue 28: the rates an engine measures from its own steps (what the router predicts waits from)."""

from __future__ import annotations

import pytest

from engine.step_rates import DECAY, StepRates


def test_rates_start_at_the_first_step_of_their_kind_the_second_replaces_the_cold_first_then_they_average():
    r = StepRates()
    assert (r.prefill_tokens_per_s, r.decode_step_s, r.decode_batch) == (0.0, 0.0, 0.0)
    r.observe(prefill_tokens=512, decode_seqs=0, seconds=2.0)  # cold
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (256.0, 0.0)
    r.observe(prefill_tokens=256, decode_seqs=3, seconds=0.5)  # a mixed step counts as prefill; replaces the first
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (512.0, 0.0)
    r.observe(prefill_tokens=1024, decode_seqs=0, seconds=1.0)  # the mean of the warm steps
    assert r.prefill_tokens_per_s == pytest.approx((512 + 1024) / 2)
    r.observe(prefill_tokens=0, decode_seqs=8, seconds=0.2)
    r.observe(prefill_tokens=0, decode_seqs=4, seconds=0.01)
    r.observe(prefill_tokens=0, decode_seqs=6, seconds=0.03)
    assert r.decode_step_s == pytest.approx((0.01 + 0.03) / 2)
    assert r.decode_batch == pytest.approx((4 + 6) / 2)
    for _ in range(8):  # 11 decode steps: 10 warm ones, each weighing 1/n, the last at DECAY = 1/10
        r.observe(prefill_tokens=0, decode_seqs=6, seconds=0.02)
    assert r.decode_step_s == pytest.approx(0.02)
    r.observe(prefill_tokens=0, decode_seqs=6, seconds=0.12)
    assert r.decode_step_s == pytest.approx((1 - DECAY) * 0.02 + DECAY * 0.12)
    before = (r.prefill_tokens_per_s, r.decode_step_s)
    r.observe(prefill_tokens=4, decode_seqs=2, seconds=0.01)  # too few prompt tokens to say anything
    r.observe(prefill_tokens=0, decode_seqs=0, seconds=0.01)
    r.observe(prefill_tokens=100, decode_seqs=0, seconds=0.0)
    assert (r.prefill_tokens_per_s, r.decode_step_s) == before
