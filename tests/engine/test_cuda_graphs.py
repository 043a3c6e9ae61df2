"""Decode CUDA graphs (`engine.cuda_graphs`, issue 19): batch sizes and their checks; on the CPU the padded,
static-input decode step a graph replays (``capture=False``) gives exactly the eager engine's tokens, with the
torch and the Triton backends; on a GPU the captured graphs do."""

from __future__ import annotations

import pytest
import torch
from kvrelay.deploy.config import load_config
from kvrelay.deploy.sizes import ConfigError
from kvrelay.engine.cuda_graphs import DecodeGraphs, check_batch_sizes, default_batch_sizes
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams

# Five prompts whose requests stop after 2, 4, 6, 8 and 10 tokens: decode steps hold 5, 4, 4, 3, 3, 2, 2, 1, 1
# sequences, so with sizes (1, 2, 4) the first runs eagerly and the others replay sizes 4, 4, 4, 4, 2, 2, 1, 1.
PROMPTS = [[(7 * s + 3 * i) % 256 for i in range(n)] for s, n in ((1, 37), (2, 70), (3, 5), (4, 16), (5, 33))]
MAX_TOKENS = (2, 4, 6, 8, 10)
SIZES = (1, 2, 4)
REPLAYS = 8


def test_default_batch_sizes_are_powers_of_two_then_multiples_of_eight_up_to_max_num_seqs() -> None:
    assert default_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_batch_sizes(3) == (1, 2, 3)
    assert default_batch_sizes(1) == (1,)


@pytest.mark.parametrize(("sizes", "message"), [
    ((), "give at least one batch size"),
    ((0,), "0 is not a positive integer"),
    ((True,), "True is not a positive integer"),
    ((4, 65), "65 is above max_num_seqs (64)"),
])
def test_bad_batch_sizes_are_refused_naming_the_field(sizes: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=r"cuda_graph_batch_sizes: ") as info:
        check_batch_sizes(sizes, max_num_seqs=64)
    assert message in str(info.value)
    with pytest.raises(ValueError, match=r"cuda_graph_batch_sizes: "):
        EngineConfig(max_num_seqs=64, cuda_graph_batch_sizes=sizes)


def test_batch_sizes_are_sorted_without_repeats() -> None:
    assert check_batch_sizes([8, 1, 8, 2], max_num_seqs=8) == (1, 2, 8)
    assert EngineConfig(max_num_seqs=8, cuda_graph_batch_sizes=(8, 1, 8)).graph_batch_sizes == (1, 8)
    assert EngineConfig(max_num_seqs=8).graph_batch_sizes == (1, 2, 4, 8)


def _yaml(tmp_path, engine: str):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {tmp_path}}}\nkvstore: {{device: {{bytes: 1MiB}}}}\nengine: {engine}\n")
    return load_config(path)


def test_yaml_engine_cuda_graph_settings(tmp_path) -> None:
    e = _yaml(tmp_path, "{max_num_seqs: 16, cuda_graphs: false, cuda_graph_batch_sizes: [4, 1, 16]}").engine
    assert (e.cuda_graphs, e.cuda_graph_batch_sizes) == (False, (1, 4, 16))
    assert (_yaml(tmp_path, "{}").engine.cuda_graphs, _yaml(tmp_path, "{}").engine.cuda_graph_batch_sizes) == (
        True, None)
    with pytest.raises(ConfigError, match=r"engine.cuda_graph_batch_sizes: 32 is above engine.max_num_seqs \(16\)"):
        _yaml(tmp_path, "{max_num_seqs: 16, cuda_graph_batch_sizes: [1, 32]}")
    with pytest.raises(ConfigError, match=r"engine.cuda_graph_batch_sizes: \[0\] is not a non-empty list"):
        _yaml(tmp_path, "{cuda_graph_batch_sizes: [0]}")
    with pytest.raises(ConfigError, match=r"engine.cuda_graphs: 'yes'"):
        _yaml(tmp_path, "{cuda_graphs: 'yes'}")


def test_capture_needs_cuda_and_a_capturable_backend(tiny_model_dir) -> None:
    engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=16, attention_backend="torch"))
    assert engine.runner.graphs is None and engine.cuda_graph_sizes == ()  # off on a CPU, whatever the config
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the KV pool is on cpu"):
        DecodeGraphs(engine.model, engine.kv_pool, engine.runner.backend, sizes=(1,), max_model_len=64, capture=True)


def _generate(engine: LLMEngine) -> list[list[int]]:
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_static_decode_steps_give_the_eager_tokens(tiny_model_dir, backend: str) -> None:
    """The forward a graph replays — one static input tensor, rows padded to the size, tables as wide as the
    context — run eagerly on the CPU: same tokens as plain eager steps, and the steps that fit replayed."""
    config = EngineConfig(num_blocks=64, max_num_seqs=8, attention_backend=backend)
    want = _generate(LLMEngine(load_model(tiny_model_dir), config))
    engine = LLMEngine(load_model(tiny_model_dir), config)
    graphs = DecodeGraphs(engine.model, engine.kv_pool, engine.runner.backend, sizes=SIZES,
                          max_model_len=engine.max_model_len, capture=False)
    assert graphs.width == -(-engine.max_model_len // engine.spec.block_size_tokens)
    engine.runner.graphs = graphs
    assert _generate(engine) == want
    assert graphs.replays == REPLAYS
    assert [len(t) for t in want] == list(MAX_TOKENS)


def test_padding_rows_write_no_kv(tiny_model_dir) -> None:
    """A one-sequence step replayed at size 4: the pool changes only in that sequence's slot."""
    engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=16, attention_backend="torch"))
    graphs = DecodeGraphs(engine.model, engine.kv_pool, engine.runner.backend, sizes=(4,), max_model_len=64,
                          capture=False)
    engine.runner.graphs = graphs
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # prefill: 5 tokens in block b, rows 0-4
    [seq] = engine.scheduler.running
    block = seq.block_table[0]
    before = engine.kv_pool.clone()
    engine.step()  # the decode of token 6: slot (block, 5); padding rows have slot -1
    assert graphs.replays == 1
    changed = (engine.kv_pool != before).nonzero()
    # [num_blocks, L, 2, Hkv, B, D]: every changed element is in block ``block``, row 5
    assert changed.numel() > 0
    assert set(changed[:, 0].tolist()) == {block} and set(changed[:, 4].tolist()) == {5}


def test_steps_with_a_long_context_policy_run_eagerly(tiny_model_dir) -> None:
    policy = LongContextConfig("h2o", device_budget_tokens=96, sink_tokens=16, recent_tokens=32)
    config = EngineConfig(num_blocks=64, max_num_seqs=8, attention_backend="torch", long_context=policy)
    want = _generate(LLMEngine(load_model(tiny_model_dir), config))
    engine = LLMEngine(load_model(tiny_model_dir), config)
    engine.runner.graphs = graphs = DecodeGraphs(engine.model, engine.kv_pool, engine.runner.backend, sizes=SIZES,
                                                 max_model_len=engine.max_model_len, capture=False)
    assert _generate(engine) == want
    assert graphs.replays == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_give_the_eager_tokens_on_cuda(tiny_model_dir) -> None:
    loaded = load_model(tiny_model_dir, dtype="float32", device="cuda")
    eager = LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_seqs=8, cuda_graphs=False))
    graphed = LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_seqs=8, cuda_graph_batch_sizes=SIZES))
    assert (eager.cuda_graph_sizes, graphed.cuda_graph_sizes) == ((), SIZES)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.capture
    assert _generate(graphed) == _generate(eager)
    assert graphed.runner.graphs.replays == REPLAYS
    torch.cuda.synchronize()
