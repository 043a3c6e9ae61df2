"""`engine.prefill_packing: priced`: a prompt joins a step in which another prompt's prefill ends only where the
measured step cost says it pays (`engine.scheduler`), and the tokens are those of packing up to the budget."""

from __future__ import annotations

import random

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams

COST = (0.01, 0.001, 0.002)  # a step: 10 ms, plus 1 ms a prompt token and 2 ms a decode row


def _engine(tiny_model_dir, packing: str = "priced", cost: tuple[float, float, float] | None = COST,
            budget: int = 1024) -> LLMEngine:
    eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=64, max_num_batched_tokens=budget,
                                                             enable_prefix_caching=False, prefill_packing=packing))
    if cost is not None:
        eng.scheduler.step_cost = lambda: cost
    return eng


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _scheduled(eng: LLMEngine, lengths: list[int]) -> list[tuple[str, int]]:
    for i, n in enumerate(lengths):
        eng.add_request(f"r{i}", _prompt(n, i), SamplingParams(max_tokens=4))
    return [(c.seq.request_id, c.num_tokens) for c in eng.scheduler.schedule().prefills]


def test_a_prompt_joins_only_where_its_delay_to_the_finishing_ones_is_below_the_steps_it_saves(tiny_model_dir):
    # r1 (30 tokens) would delay r0's first token by 30 ms to save 10 ms for itself and for r2: it waits; r2 (2
    # tokens) delays r0 by 2 ms and saves 10: it joins
    assert _scheduled(_engine(tiny_model_dir), [40, 30, 2]) == [("r0", 40), ("r2", 2)]


def test_fill_and_an_unfitted_step_cost_pack_up_to_the_budget(tiny_model_dir):
    assert _scheduled(_engine(tiny_model_dir, "fill"), [40, 30, 2]) == [("r0", 40), ("r1", 30), ("r2", 2)]
    assert _scheduled(_engine(tiny_model_dir, cost=(0.0, 0.0, 0.0)), [40, 30, 2]) == [("r0", 40), ("r1", 30),
                                                                                   ("r2", 2)]
    assert EngineConfig().prefill_packing == "fill"


def test_a_queue_of_short_prompts_joins_while_the_fixed_costs_saved_outweigh_the_delay(tiny_model_dir):
    # with k prompts ending in the step and m queued from the candidate on: joins while k * 8 ms <= m * 10 ms
    # (k=1, m=5: yes; 2, 4: yes; 3, 3: yes; 4, 2: no; 4, 1: no)
    got = _scheduled(_engine(tiny_model_dir), [8] * 6)
    assert got == [(f"r{i}", 8) for i in range(4)]


def test_decode_rows_make_the_step_a_prompt_saves_dearer(tiny_model_dir):
    # six sequences decoding: the step r1 would wait for costs 10 + 6 * 2 = 22 ms, for r1 and r2 44 ms, more than
    # the 30 ms r1 delays r0 by: it joins, and r2 (2 ms) too
    eng = _engine(tiny_model_dir, cost=None)
    for i in range(6):
        eng.add_request(f"d{i}", _prompt(3, 10 + i), SamplingParams(max_tokens=50))
    eng.step()  # their prompts, packed (no cost yet); from now on they decode
    eng.scheduler.step_cost = lambda: COST
    assert _scheduled(eng, [40, 30, 2]) == [("r0", 40), ("r1", 30), ("r2", 2)]


def test_a_prompt_that_would_not_end_in_the_step_does_not_join(tiny_model_dir):
    # r0 ends in the step and r1 (1 token) joins it; r2 (40 tokens, 23 of the budget left) would only start: it waits
    assert _scheduled(_engine(tiny_model_dir, budget=64), [40, 1, 40]) == [("r0", 40), ("r1", 1)]
    # the first prompt of a step is never held back, even one the budget chunks
    assert _scheduled(_engine(tiny_model_dir, budget=24), [40, 1]) == [("r0", 24)]


def test_the_engine_prices_by_its_own_fitted_step_cost(tiny_model_dir):
    eng = _engine(tiny_model_dir, cost=None)
    eng.generate([_prompt(20, 0), _prompt(5, 1)], SamplingParams(max_tokens=6))
    assert eng.scheduler.step_cost() == eng.rates.cost.coefficients


@pytest.mark.parametrize("packing", ["priced", "fill"])
def test_packing_changes_no_token(tiny_model_dir, packing):
    prompts = [_prompt(n, i) for i, n in enumerate((40, 30, 2, 8, 8, 70))]
    params = SamplingParams(max_tokens=10)
    alone = [_engine(tiny_model_dir, "fill", cost=None).generate([p], params)[0][0] for p in prompts]
    eng = _engine(tiny_model_dir, packing, budget=64)
    assert [out for [out] in eng.generate(prompts, params)] == alone
    eng.check_integrity()
    assert eng.pool.stats().num_in_use == 0


def test_an_unknown_packing_is_refused_by_name():
    with pytest.raises(ValueError, match="prefill_packing must be one of fill, priced, got 'greedy'"):
        EngineConfig(prefill_packing="greedy")
