"""`benchmarks.long_context_task`: the copy task, training batches, caching, and the Hugging Face export."""

from __future__ import annotations

import json

import pytest
import torch
from kvrelay.benchmarks.long_context_task import (
    BOS_ID,
    CONTENT_BASE_ID,
    CONTENT_VOCAB,
    CUE_TOKENS,
    SEP_ID,
    VOCAB_SIZE,
    TrainConfig,
    ensure_model,
    make_examples,
    training_batch,
)
from kvrelay.benchmarks.long_context_train import LlamaShape, TrainingLlama, export_hf
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams


def test_examples_are_deterministic_per_seed():
    kwargs = {"context_tokens": 64, "answer_tokens": 16}
    assert make_examples(4, seed=3, **kwargs) == make_examples(4, seed=3, **kwargs)
    assert make_examples(4, seed=3, **kwargs) != make_examples(4, seed=4, **kwargs)


def test_example_layout_and_answer_is_the_continuation():
    for e in make_examples(20, seed=11, context_tokens=64, answer_tokens=16):
        assert len(e.prompt_ids) == 1 + 64 + 1 + CUE_TOKENS and len(e.answer_ids) == 16
        assert e.prompt_ids[0] == BOS_ID and e.prompt_ids[65] == SEP_ID
        run, cue = e.prompt_ids[1:65], e.prompt_ids[66:]
        assert len(set(run)) == 64
        assert all(CONTENT_BASE_ID <= t < CONTENT_BASE_ID + CONTENT_VOCAB for t in run)
        start = run.index(cue[0])
        assert run[start:start + CUE_TOKENS] == cue
        assert run[start + CUE_TOKENS:start + CUE_TOKENS + 16] == e.answer_ids


def test_examples_reject_contexts_that_do_not_fit():
    with pytest.raises(ValueError, match="context_tokens"):
        make_examples(1, seed=0, context_tokens=19, answer_tokens=16)
    with pytest.raises(ValueError, match="context_tokens"):
        make_examples(1, seed=0, context_tokens=CONTENT_VOCAB + 1, answer_tokens=16)


def test_training_batch_scores_run_successors_in_every_segment():
    batch = training_batch(torch.Generator().manual_seed(0), batch_size=3, context_tokens=48, segments=3,
                           segment_tokens=6)
    again = training_batch(torch.Generator().manual_seed(0), batch_size=3, context_tokens=48, segments=3,
                           segment_tokens=6)
    assert torch.equal(batch.input_ids, again.input_ids) and torch.equal(batch.target_ids, again.target_ids)
    assert batch.input_ids.shape == (3, 1 + 48 + 3 * 7 - 1)
    for ids, targets in zip(batch.input_ids.tolist(), batch.target_ids.tolist()):
        run = ids[1:49]
        assert ids[0] == BOS_ID and len(set(run)) == 48
        assert [i for i, t in enumerate(ids) if t == SEP_ID] == [49, 56, 63]
        scored = [i for i, t in enumerate(targets) if t >= 0]
        assert len(scored) == 3 * 5
        assert all(targets[i] == run[run.index(ids[i]) + 1] for i in scored)
        copied = [t for i, t in enumerate(ids) if i > 49 and t != SEP_ID]
        assert len(set(copied)) == len(copied)  # segments never overlap


def test_ensure_model_returns_the_cached_directory_without_training(tmp_path):
    cached = tmp_path / f"long-context-{TrainConfig().digest(0)}"
    cached.mkdir()
    assert ensure_model(tmp_path, seed=0) == cached
    assert TrainConfig().digest(0) != TrainConfig().digest(1)


def _tiny_training_model() -> TrainingLlama:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return TrainingLlama(LlamaShape(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                                        num_layers=2, num_heads=4, num_kv_heads=2))


@torch.no_grad()
def _training_greedy(model: TrainingLlama, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        hidden = model(torch.tensor([ids]))[0, -1]
        ids.append(int(model.lm_head(hidden).argmax()))
    return ids[len(prompt):]


def test_export_loads_into_the_serving_engine_with_the_same_greedy_tokens(tmp_path):
    model = _tiny_training_model().eval()
    out = export_hf(model, tmp_path / "model")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["head_dim"]) == ("llama", VOCAB_SIZE, 16)
    assert config["max_position_embeddings"] >= 2048
    loaded = load_model(out)
    assert torch.equal(loaded.model.lm_head.weight, model.model.embed_tokens.weight)
    prompts = [e.prompt_ids for e in make_examples(2, seed=1, context_tokens=40, answer_tokens=8)] + [[BOS_ID, 300]]
    engine = LLMEngine(loaded, EngineConfig(num_blocks=32, block_size_tokens=16))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.close()
    assert [out[0] for out in outputs] == [_training_greedy(model, p, 6) for p in prompts]

