"""Issue 28: the rates an engine measures from its own steps (what the router predicts waits from)."""

from __future__ import annotations

import pytest
from kvrelay.engine.step_rates import DECAY, STEP_COST_DECAY, StepCost, StepRates


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


def fitted(c: StepCost) -> tuple[float, float, float]:
    return tuple(round(x, 12) for x in c.coefficients)  # type: ignore[return-value]


def test_step_cost_fits_fixed_per_token_and_per_row_seconds_from_mixed_steps():
    c = StepCost()
    assert (c.samples, c.coefficients) == (0, (0.0, 0.0, 0.0))
    c.observe(512, 0, 5.0)  # cold: stands alone, then the second step replaces it
    steps = [(512, 0), (0, 4), (64, 3), (0, 9), (300, 1), (128, 12), (0, 1)]
    for p, d in steps:
        c.observe(p, d, 0.01 + 0.001 * p + 0.002 * d)
    assert fitted(c) == (0.01, 0.001, 0.002)
    assert StepRates().cost.samples == 0
    r = StepRates()
    for p, d in [(0, 0), *steps, *steps]:  # a step with nothing in it is not folded in
        r.observe(prefill_tokens=p, decode_seqs=d, seconds=0.01 + 0.001 * p + 0.002 * d)
    assert (r.cost.samples, fitted(r.cost)) == (14, (0.01, 0.001, 0.002))


def test_step_cost_leaves_a_term_the_steps_never_vary_at_zero_and_never_goes_negative():
    prefill_node = StepCost()
    for p in (0, 100, 300, 200, 512):
        if p:
            prefill_node.observe(p, 0, 0.02 + 0.001 * p)
    assert fitted(prefill_node) == (0.02, 0.001, 0.0)
    decode_node = StepCost()
    for d in (1, 1, 4, 2, 8):
        decode_node.observe(0, d, 0.005 + 0.003 * d)
    assert fitted(decode_node) == (0.005, 0.0, 0.003)
    one = StepCost()
    one.observe(100, 0, 0.1)  # one step of one kind: a rate through the origin, as StepRates had it
    assert fitted(one) == (0.0, 0.001, 0.0)
    shrinking = StepCost()  # more rows, less time (noise): a negative slope is not physical; the mean stands
    for d, y in ((1, 0.03), (1, 0.03), (2, 0.029), (3, 0.028), (4, 0.027)):
        shrinking.observe(0, d, y)
    k = 1 - STEP_COST_DECAY  # the decayed mean of the four warm steps
    mean = (k**3 * 0.03 + k**2 * 0.029 + k * 0.028 + 0.027) / (k**3 + k**2 + k + 1)
    assert fitted(shrinking) == (pytest.approx(mean), 0.0, 0.0)


def test_step_cost_weighs_the_newest_step_by_its_decay():
    c = StepCost()
    for _ in range(3):
        c.observe(0, 0, 1.0)  # nothing computed: ignored by StepRates, a fixed cost here
    c.observe(0, 0, 2.0)
    # samples 2-4 (the first replaced): weights (1-δ)², (1-δ), 1 on 1.0, 1.0, 2.0
    k = 1 - STEP_COST_DECAY
    assert c.coefficients[0] == pytest.approx((k * k + k + 2.0) / (k * k + k + 1))
