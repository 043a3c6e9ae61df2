"""Issue 15: ``from kvrelay import LLM, SamplingParams`` — vLLM's offline API over the server's engine."""

from __future__ import annotations

import pytest
from kvrelay.deploy.sizes import ConfigError
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
from kvrelay.model.loader import load_model
from kvrelay.model.tokenizer import load_tokenizer

from kvrelay import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=8)
    yield llm
    llm.close()


def test_generate_text_and_ids_in_prompt_order_equal_the_engine(llm, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    prompts = ["Hello, my name is", "The capital of France is", [5, 6, 7, 8]]
    params = [SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=5, seed=3, n=2),
              SamplingParams(max_tokens=4, temperature=0, logprobs=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=64))
    want = engine.generate([tok.encode(prompts[0]), tok.encode(prompts[1]), [5, 6, 7, 8]], params)
    assert [o.prompt for o in outs] == ["Hello, my name is", "The capital of France is", None]
    assert outs[2].prompt_token_ids == [5, 6, 7, 8]
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert [[c.text for c in o.outputs] for o in outs] == [[tok.decode(ids) for ids in w] for w in want]
    assert [c.index for c in outs[1].outputs] == [0, 1]
    assert outs[0].outputs[0].finish_reason in ("length", "stop") and outs[0].outputs[0].logprobs is None
    assert len(outs[2].outputs[0].logprobs) == len(outs[2].outputs[0].token_ids)
    assert all(len(lp.top) == 2 for lp in outs[2].outputs[0].logprobs)
    [one] = llm.generate("a single prompt", SamplingParams(max_tokens=3), use_tqdm=False)
    assert one.prompt == "a single prompt" and len(one.outputs[0].token_ids) <= 3


def test_chat_renders_the_template(llm, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "hi there"}]
    [out] = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert out.prompt_token_ids == ids
    [again] = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


def test_bad_input_is_named_and_the_engine_is_left_clean(llm, tiny_model_dir):
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate([[5, 6], []], use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the good prompt added before the bad one was taken back
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ConfigError, match="kvstore.device.bytes"):
        LLM(model=tiny_model_dir, kv_cache_memory="lots")
    with pytest.raises(ConfigError, match="not both"):
        LLM(model=tiny_model_dir, kv_cache_memory="8MiB", gpu_memory_utilization=0.5)


def test_sampling_params_take_vllms_defaults_and_the_engine_takes_them_as_they_are():
    from kvrelay.model.sampling_params import SamplingParams as EngineSamplingParams

    params = SamplingParams()
    assert (params.temperature, params.max_tokens, params.top_p, params.top_k, params.min_p) == (1.0, 16, 1.0, 0, 0.0)
    assert not params.greedy and isinstance(params, EngineSamplingParams)
    assert EngineSamplingParams().temperature == 0.0  # the engine's own class stays greedy for internal callers


def test_default_params_come_from_generation_config(tmp_path):
    import json
    import shutil

    from kvrelay.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "model", seed=0)
    cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.6, "top_k": 20,
                                                              "max_new_tokens": 7}))
    llm = LLM(model=model, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=2)
    try:
        got = llm.get_default_sampling_params()
        assert (got.temperature, got.top_k, got.top_p, got.max_tokens) == (0.6, 20, 1.0, 7)
    finally:
        llm.close()
    plain = LLM(model=model, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=2, generation_config="vllm")
    try:
        got = plain.get_default_sampling_params()
        assert (got.temperature, got.top_k, got.max_tokens) == (1.0, 0, 16)
    finally:
        plain.close()
    shutil.rmtree(model)


def test_a_hub_repo_id_loads_its_cached_snapshot_and_generates_as_the_directory(llm, tiny_model_dir, tmp_path):
    """Issue 64: ``LLM("ORG/NAME")`` through the hub cache (laid out by the test; offline: tests/conftest.py)."""
    from tests.hub_cache import write_hub_snapshot

    hub = tmp_path / "hub"
    snapshot = write_hub_snapshot(hub, "kvtest/tiny", tiny_model_dir)
    by_name = LLM("kvtest/tiny", download_dir=hub, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=8)
    try:
        assert (by_name.config.model.path, by_name.config.model.name) == (str(snapshot), "kvtest/tiny")
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
        [got] = by_name.generate([[5, 6, 7, 8]], params, use_tqdm=False)
        [want] = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) == 6
    finally:
        by_name.close()


def test_device_auto_and_gpu_memory_utilization_ignored_on_cpu(tiny_model_dir, caplog):
    """Issue 64: the device defaults to auto (here the CPU); vLLM's gpu_memory_utilization means nothing on a CPU
    device, so the KV takes kv_cache_memory's CPU default and a warning says so."""
    import logging

    import torch
    from kvrelay.deploy.sizes import parse_size

    from kvrelay.llm import CPU_KV_CACHE_MEMORY

    if torch.cuda.is_available():
        pytest.skip("auto is CUDA on this machine")
    with caplog.at_level(logging.WARNING, logger="kvrelay.llm"):
        llm = LLM(model=tiny_model_dir, dtype="float32", gpu_memory_utilization=0.5, max_num_seqs=8)
    try:
        assert llm.config.model.device == "cpu" and llm.config.kvstore.device.size_bytes == parse_size("1GiB")
        assert llm.engine.config.num_blocks == parse_size(CPU_KV_CACHE_MEMORY) // llm.engine.spec.block_bytes
        assert [r.getMessage() for r in caplog.records if r.name == "kvrelay.llm"] == [
            "gpu_memory_utilization=0.5 is ignored on cpu (it is a share of a GPU's memory, as vLLM's is); the KV "
            "takes 1GiB: pass kv_cache_memory to size it"]
    finally:
        llm.close()
    with pytest.raises(ConfigError, match=r"^device 'gpu' is not a device; use auto, cpu, cuda or cuda:N$"):
        LLM(model=tiny_model_dir, device="gpu")


def test_prompt_logprobs_as_vllms_request_output(llm, tiny_model_dir):
    """Issue 64: ``SamplingParams(prompt_logprobs=k)`` gives ``RequestOutput.prompt_logprobs``: None first, then the
    engine's entries (exact against transformers in tests/engine/test_prompt_logprobs.py)."""
    prompt = [5, 6, 7, 8, 9]
    asked, plain = llm.generate([prompt, prompt], [SamplingParams(max_tokens=2, prompt_logprobs=3),
                                                   SamplingParams(max_tokens=2)], use_tqdm=False)
    assert plain.prompt_logprobs is None
    engine = LLMEngine(load_model(tiny_model_dir, dtype="float32"), EngineConfig(num_blocks=64))
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, prompt_logprobs=3))
    want = [out.prompt_logprobs for out in engine.step()][0]
    assert asked.prompt_logprobs[0] is None and len(asked.prompt_logprobs) == len(prompt)
    for got, ref in zip(asked.prompt_logprobs[1:], want, strict=True):
        assert (got.rank, [t for t, _ in got.top]) == (ref.rank, [t for t, _ in ref.top])
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-5)
