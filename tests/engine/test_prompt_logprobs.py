"""Issue 64: vLLM's ``prompt_logprobs``: each prompt token's logprob, rank and top alternatives are the
log_softmax of transformers' logits over the prompt (float32), however the prompt is chunked, and a prompt whose
logprobs are asked for is computed in full rather than read from the prefix cache."""

from __future__ import annotations

import pytest
import torch
from kvrelay.engine import prompt_logprobs as prompt_logprobs_module
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError, StepOutput
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(45)]  # 45 tokens: two full 16-token blocks and a partial one


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_tiny) -> torch.Tensor:
    """``[P, vocab]``: transformers' log_softmax at each prompt position (row p predicts token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf_tiny(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    engine.add_request(request_id, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    engine.check_integrity()
    return outs


@pytest.mark.parametrize("batched_tokens", [2048, 16])  # one chunk; three chunks across three steps
def test_prompt_logprobs_equal_log_softmax_of_the_reference_forward(tiny_model_dir, reference, monkeypatch,
                                                                     batched_tokens):
    monkeypatch.setattr(prompt_logprobs_module, "LOGITS_ROWS", 5)  # several logits slices per chunk
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"),
                       EngineConfig(num_blocks=64, max_num_batched_tokens=batched_tokens))
    outs = run(engine, "r", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3))
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].new_token_ids  # with the first token, once
    entries = carrying[0].prompt_logprobs
    assert len(entries) == len(PROMPT) - 1
    for p, entry in enumerate(entries, start=1):
        want = reference[p - 1]
        tok = PROMPT[p]
        assert entry.logprob == pytest.approx(float(want[tok]), abs=1e-4)
        assert entry.rank == int((want >= want[tok]).sum())
        top = torch.topk(want, 3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_a_cached_prompt_is_computed_again_for_its_logprobs_and_others_still_hit(tiny_model_dir):
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=64))
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    asked = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    run(engine, "warm", PROMPT, plain)
    first = run(engine, "a", PROMPT, asked)
    assert first[0].num_cached_prompt_tokens == 0  # the two cached blocks were not used
    entries = first[0].prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) - 1 and all(e.top == () for e in entries)
    again = run(engine, "b", PROMPT, plain)
    assert again[0].num_cached_prompt_tokens == 32 and again[0].prompt_logprobs is None
    assert run(engine, "c", PROMPT, asked)[0].prompt_logprobs == entries


def test_only_sample_zero_carries_them_and_a_one_token_prompt_has_none(tiny_model_dir):
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=64))
    outs = run(engine, "n", PROMPT, SamplingParams(max_tokens=2, n=3, temperature=1.0, seed=1, prompt_logprobs=1))
    assert [(o.index, len(o.prompt_logprobs)) for o in outs if o.prompt_logprobs is not None] == [(0, 44)]
    one = run(engine, "one", [9], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert one[0].prompt_logprobs == []


def test_none_for_a_request_that_arrives_with_its_first_token_and_whole_vocabulary_refused(tiny_model_dir):
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=64))
    engine.add_request("d", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2),
                       first_token_ids=[5])
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [o.prompt_logprobs for o in outs] == [None, None]  # its prompt's logprobs came from the prefill node
    with pytest.raises(RequestError, match=r"prompt_logprobs -1 asks for the whole vocabulary \(258 tokens\)"):
        engine.add_request("v", PROMPT, SamplingParams(prompt_logprobs=-1))
