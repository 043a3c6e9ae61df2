"""Issue 15: each token's logprob and top alternatives come from the distribution it was drawn from:
log_softmax of the reference logits (transformers) over the temperature."""

from __future__ import annotations

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams


def run_with_logprobs(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request("r", prompt, params)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or [])
    return tokens, logprobs


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_log_softmax_of_the_reference_logits(tiny_model_dir, hf_tiny, temperature):
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=64))
    prompt = [12, 40, 41, 99, 7]
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=11, logprobs=5, ignore_eos=True)
    tokens, logprobs = run_with_logprobs(engine, prompt, params)
    assert len(tokens) == len(logprobs) == 10
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        with torch.no_grad():
            logits = hf_tiny(torch.tensor([prompt + tokens[:i]])).logits[0, -1].float()
        want = torch.log_softmax(logits / (temperature or 1.0), -1)  # greedy: the logits' own distribution
        assert lp.logprob == pytest.approx(float(want[tok]), abs=1e-4)
        top = torch.topk(want, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        if temperature == 0.0:
            assert lp.top[0][0] == tok


def test_no_logprobs_unless_asked_and_zero_gives_only_the_sampled_token(tiny_model_dir):
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=64))
    _, none = run_with_logprobs(engine, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert none == []
    tokens, zero = run_with_logprobs(engine, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0))
    assert len(zero) == 3 and all(lp.top == () and lp.logprob <= 0 for lp in zero)
