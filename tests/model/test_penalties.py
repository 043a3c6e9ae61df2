"""Issue 15: min_tokens, logit_bias, repetition/frequency/presence penalties and min_p, each against a
plain reference (Python loops over the vocabulary, logits from `transformers`) over seeded runs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams, adjust_logits, sample, token_generator


def reference_adjust(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int],
                     eos: set[int]) -> list[float]:
    out = list(logits)
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            out[t] = -math.inf
    for t, b in p.logit_bias:
        out[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


CASES = {
    "presence": SamplingParams(max_tokens=24, presence_penalty=1.5),
    "frequency": SamplingParams(max_tokens=24, frequency_penalty=1.2),
    "repetition": SamplingParams(max_tokens=24, repetition_penalty=1.3),
    "negative penalties": SamplingParams(max_tokens=24, presence_penalty=-0.5, frequency_penalty=-0.3),
    "logit_bias": SamplingParams(max_tokens=24, logit_bias=((5, 8.0), (7, -100.0), (11, 2.5))),
    "all, sampled": SamplingParams(max_tokens=24, temperature=0.7, seed=3, presence_penalty=0.4,
                                   frequency_penalty=0.6, repetition_penalty=1.1, logit_bias=((9, 1.0),)),
    "min_p, sampled": SamplingParams(max_tokens=24, temperature=1.0, seed=5, min_p=0.2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_adjusted_logits_equal_the_reference(name):
    params = CASES[name]
    rng = random.Random(name)
    for _ in range(5):
        vocab = 64
        logits = [rng.uniform(-6, 6) for _ in range(vocab)]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        row = torch.tensor(logits, dtype=torch.float32)
        adjust_logits(row, params, (prompt, output), {3})
        want = reference_adjust([float(x) for x in torch.tensor(logits, dtype=torch.float32)], params, prompt,
                                output, {3})
        assert row.tolist() == pytest.approx(want, rel=1e-6, abs=1e-5)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    row = torch.zeros(16)
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(4,))
    adjust_logits(row, params, ([1, 2], [5, 6]), {2})
    assert torch.isinf(row[[2, 4]]).all() and torch.isfinite(row[[0, 1, 3, 5]]).all()
    row = torch.zeros(16)
    adjust_logits(row, params, ([1, 2], [5, 6, 7]), {2})  # three outputs: free to stop
    assert torch.isfinite(row).all()
    row = torch.zeros(16)
    adjust_logits(row, SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True), ([1], []), {2})
    assert torch.isfinite(row).all()  # ignore_eos: EOS is not a stop token to hold back


def _reference_generate(hf_model, prompt: list[int], p: SamplingParams, eos: set[int]) -> list[int]:
    """Full forward each step (transformers), the reference adjustments, then greedy or the engine's
    per-token generator over the reference probabilities (temperature, then min_p)."""
    output: list[int] = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].float()
        scores = torch.tensor(reference_adjust(logits.tolist(), p, prompt, output, eos))
        if p.greedy:
            tok = int(torch.argmax(scores))
        else:
            scores = scores / p.temperature
            if p.min_p:
                probs = torch.softmax(scores, -1)
                scores = scores.masked_fill(probs < p.min_p * probs.max(), -math.inf)
            gen = token_generator(p.seed, 0, len(output), torch.device("cpu"))
            tok = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))
        output.append(tok)
        if len(output) >= p.min_tokens and ((not p.ignore_eos and tok in eos) or tok in p.stop_token_ids):
            break
    return output


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_runs_equal_the_reference_generation(tiny_model_dir, hf_tiny, name):
    params = CASES[name]
    loaded = load_model(tiny_model_dir, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    prompt = [17, 23, 23, 40, 17, 99, 5, 5, 5, 61]
    [[got]] = engine.generate([prompt], params)
    plain = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, seed=params.seed)
    [[without]] = engine.generate([prompt], plain)
    assert got == _reference_generate(hf_tiny, prompt, params, set(engine.eos_token_ids))
    assert got != without  # the setting changed the run (it is not silently ignored)


def test_min_tokens_in_an_engine_run(tiny_model_dir, hf_tiny):
    loaded = load_model(tiny_model_dir, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    prompt = [30, 31, 32, 33]
    [[free]] = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    stop = free[1]  # greedy picks it second: as a stop token, the run would end after two tokens
    [[short]] = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop,), min_tokens=6)
    [[held]] = engine.generate([prompt], params)
    assert len(short) == 2 and len(held) >= 6 and stop not in held[:6]
    assert held == _reference_generate(hf_tiny, prompt, params, set(engine.eos_token_ids))


def test_a_caller_s_argmax_serves_only_greedy_rows_whose_logits_nothing_adjusts():
    """`sample`'s ``argmax`` (the fused decode step's greedy tokens): a greedy row takes it as given; a greedy row
    with a logit bias searches its adjusted logits; a sampled row draws as it would without it."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, logit_bias=((2, 10.0),)),
              SamplingParams(max_tokens=1, temperature=1.0, seed=7)]
    histories = [None, ([4], []), None]

    def draw(argmax):
        gens = [None, None, token_generator(7, 0, 0, torch.device("cpu"))]
        return sample(logits.clone(), params, gens, histories, argmax=argmax)[0]

    without, given = draw(None), draw([0, 0, 0])
    assert without[:2] == [1, 2]
    assert given[:2] == [0, 2]  # row 0 took the caller's token (not its own logits' 1); row 1 searched its own
    assert given[2] == without[2]
