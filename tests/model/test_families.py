"""Every family `kvrelay tiny-model --arch` writes: greedy tokens equal transformers' (float32, eager), one
by one and batched, through the engine and through ``kvrelay generate``; the model's parts are the ones the
family names; exact expert routing against a plain reference."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
from kvrelay.model.config import ModelConfig, MoeConfig
from kvrelay.model.llama import MLP
from kvrelay.model.loader import load_model
from kvrelay.model.moe import SparseMoe, activate, experts_grouped, route
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tiny import TINY_ARCHS, TINY_WINDOW, write_tiny_model

OUT_TOKENS = 40
LENGTHS = (1, 15, 16, 17, 100, 2 * TINY_WINDOW + 7)  # the last two reach past gpt-oss's window of 32
GREEDY = SamplingParams(max_tokens=OUT_TOKENS, min_tokens=OUT_TOKENS)  # as transformers' min_new_tokens


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: write_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch=arch, layers=4)
            for arch in TINY_ARCHS}


def _prompts(lengths: tuple[int, ...] = LENGTHS, seed: int = 4) -> list[list[int]]:
    """Seed 4: every family's greedy choice over these prompts wins by ≥ 1.8e-3 in transformers' logits
    (seed 3 has a 1e-5 near-tie, which float32 summation order may flip)."""
    rng = random.Random(seed)
    return [[rng.randrange(258) for _ in range(n)] for n in lengths]


def _hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=OUT_TOKENS, min_new_tokens=OUT_TOKENS,
                              do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_tokens_equal_transformers_one_by_one_and_batched(family_dirs, arch):
    path = family_dirs[arch]
    prompts = _prompts()
    expected = _hf_greedy(path, prompts)
    assert len({tuple(e) for e in expected}) == len(prompts)  # the model's output depends on the prompt
    engine = LLMEngine(load_model(path), EngineConfig(num_blocks=128, max_num_batched_tokens=64))
    one_by_one = [engine.generate([p], GREEDY)[0][0] for p in prompts]
    batched = [o[0] for o in engine.generate(prompts, GREEDY)]  # chunked prefill: 64 tokens a step
    for n, exp, one, both in zip(LENGTHS, expected, one_by_one, batched, strict=True):
        assert one == exp, f"{arch}, prompt length {n}"
        assert both == exp, f"{arch}, prompt length {n}, batched"
    engine.check_integrity()
    assert engine.pool.stats().num_in_use == 0


def test_kvrelay_generate_serves_every_family(family_dirs):
    prompt = _prompts()[-1]
    # One `kvrelay generate` process per family, all started at once (each spends most of its time importing);
    # transformers' tokens are computed here meanwhile.
    runs = {arch: subprocess.Popen(
        [sys.executable, "-m", "kvrelay.deploy.cli", "generate", "--model", str(family_dirs[arch]), "--prompt-ids",
         ",".join(map(str, prompt)), "--max-tokens", str(OUT_TOKENS), "--min-tokens", str(OUT_TOKENS),
         "--dtype", "float32", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    ) for arch in TINY_ARCHS}
    try:
        expected = {arch: _hf_greedy(family_dirs[arch], [prompt])[0] for arch in TINY_ARCHS}
        for arch, proc in runs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, (arch, stderr[-2000:])
            assert json.loads(stdout)["token_ids"] == expected[arch], arch
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_each_family_builds_the_parts_it_names(family_dirs):
    configs = {arch: load_model(d) for arch, d in family_dirs.items()}
    qwen3 = configs["qwen3"].model.model.layers[0].self_attn
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.num_heads * qwen3.head_dim == 128  # hidden 64
    assert configs["qwen3"].model.lm_head.weight is configs["qwen3"].model.model.embed_tokens.weight
    moe_layers = configs["qwen3-moe"].model.model.layers
    assert isinstance(moe_layers[0].mlp, MLP) and all(isinstance(x.mlp, SparseMoe) for x in moe_layers[1:])
    assert configs["qwen3-moe"].config.moe.sparse_layers == (False, True, True, True)
    mixtral = configs["mixtral"].model.model.layers[0]
    assert isinstance(mixtral.block_sparse_moe, SparseMoe) and not hasattr(mixtral, "mlp")
    gpt = configs["gpt-oss"]
    assert gpt.config.layer_windows == (TINY_WINDOW, None, TINY_WINDOW, None)
    assert [layer.self_attn.window for layer in gpt.model.model.layers] == [TINY_WINDOW, None, TINY_WINDOW, None]
    assert gpt.config.rope.rope_type == "yarn" and gpt.config.rope.attention_factor > 1
    attn = gpt.model.model.layers[1].self_attn
    assert attn.has_sinks and attn.sinks_f32.dtype == torch.float32 and attn.q_proj.bias is not None


def test_gpt_oss_expert_tensors_are_held_once_as_views_of_the_restacked_weights(family_dirs):
    from safetensors import safe_open

    moe = load_model(family_dirs["gpt-oss"]).model.model.layers[0].mlp
    with safe_open(family_dirs["gpt-oss"] / "model.safetensors", "pt") as f:
        stored = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj")  # [E, H, 2I], gate/up interleaved
        stored_bias = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias")
        down = f.get_tensor("model.layers.0.mlp.experts.down_proj")  # [E, I, H]
    inter = stored.shape[2] // 2
    assert torch.equal(moe.w_gate_up[:, :inter], stored[..., 0::2].transpose(1, 2))  # gate rows first
    assert torch.equal(moe.w_gate_up[:, inter:], stored[..., 1::2].transpose(1, 2))
    assert torch.equal(moe.b_gate_up[:, :inter], stored_bias[:, 0::2])
    assert torch.equal(moe.w_down, down.transpose(1, 2))
    ex = moe.experts
    assert ex.gate_up_proj.untyped_storage().data_ptr() == moe.w_gate_up.untyped_storage().data_ptr()
    assert torch.equal(ex.gate_up_proj.reshape(stored.shape), stored)


def test_windowed_and_sink_models_refuse_long_context_policies(family_dirs):
    from kvrelay.engine.long_context import LongContextConfig

    engine = LLMEngine(load_model(family_dirs["gpt-oss"]), EngineConfig(num_blocks=64))
    with pytest.raises(ValueError, match="policy h2o is not supported for a model with sliding-window layers"):
        engine.check_long_context(LongContextConfig(policy="h2o"))
    with pytest.raises(RequestError):
        engine.add_request("r", [1] * 5000, GREEDY)  # past max_position_embeddings 2048
    assert engine.pool.stats().num_in_use == 0


# ---- routing, against a plain per-token reference ----

def _moe(**kw) -> MoeConfig:
    base = dict(num_experts=4, top_k=2, intermediate_size=8, routing="softmax_topk", norm_topk_prob=False,
                router_bias=False, expert_bias=False, activation="silu", sparse_layers=(True,))
    return MoeConfig(**{**base, **kw})


def _plain_route(logits: list[float], moe: MoeConfig) -> tuple[list[float], list[int]]:
    """Sorted by value, ties to the lower expert id (as torch.topk on CPU)."""
    import math

    if moe.routing == "softmax_topk":
        m = max(logits)
        exp = [math.exp(v - m) for v in logits]
        probs = [e / sum(exp) for e in exp]
        ids = sorted(range(len(probs)), key=lambda i: (-probs[i], i))[: moe.top_k]
        w = [probs[i] for i in ids]
        if moe.norm_topk_prob:
            w = [x / sum(w) for x in w]
        return w, ids
    ids = sorted(range(len(logits)), key=lambda i: (-logits[i], i))[: moe.top_k]
    m = max(logits[i] for i in ids)
    exp = [math.exp(logits[i] - m) for i in ids]
    return [e / sum(exp) for e in exp], ids


@pytest.mark.parametrize("routing,norm", [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)])
def test_routing_equals_a_plain_reference_and_transformers_routers_including_ties(routing, norm):
    moe = _moe(routing=routing, norm_topk_prob=norm, num_experts=6, top_k=3)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 6, generator=gen)
    logits[0] = torch.tensor([0.5, 2.0, 2.0, 2.0, -1.0, 2.0])  # four-way tie for three places
    logits[1] = torch.zeros(6)  # all tied
    weights, ids = route(logits, moe)
    assert weights.dtype == torch.float32 and ids.shape == (50, 3)
    for t in range(2, 50):  # no ties: exactly the plain reference
        w, i = _plain_route(logits[t].tolist(), moe)
        assert ids[t].tolist() == i, t
        assert weights[t].tolist() == pytest.approx(w, abs=1e-6), t
    for t in (0, 1):  # ties: three of the tied experts, each with the tied weight
        w, _ = _plain_route(logits[t].tolist(), moe)
        top = logits[t].max()
        assert len(set(ids[t].tolist())) == 3 and all(logits[t, e] == top for e in ids[t].tolist())
        assert weights[t].tolist() == pytest.approx(w, abs=1e-6)
    if norm or routing == "topk_softmax":
        torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    else:
        assert (weights.sum(-1) < 1).all()
    # and exactly transformers' own routers (ties broken the same way), given the same logits
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen

    if routing == "topk_softmax":
        hf = gpt.GptOssTopKRouter(transformers_config("GptOssConfig", num_local_experts=6, num_experts_per_tok=3))
    else:
        hf = qwen.Qwen3MoeTopKRouter(transformers_config("Qwen3MoeConfig", num_experts=6, num_experts_per_tok=3,
                                                          norm_topk_prob=norm))
    with torch.no_grad():
        hf.weight.copy_(torch.eye(6))
        if hasattr(hf, "bias"):
            hf.bias.zero_()
        _, hf_weights, hf_ids = hf(logits)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights.float())


def transformers_config(name: str, **kw):
    import transformers

    return getattr(transformers, name)(hidden_size=6, num_attention_heads=2, num_key_value_heads=1, **kw)


def test_gpt_oss_router_bias_changes_the_choice():
    moe = _moe(routing="topk_softmax", router_bias=True, top_k=1)
    x = torch.ones(1, 3)
    weight = torch.tensor([[1.0, 0, 0], [0.9, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert route(torch.nn.functional.linear(x, weight), moe)[1].tolist() == [[0]]
    bias = torch.tensor([0.0, 0.2, 0.0, 0.0])
    weights, ids = route(torch.nn.functional.linear(x, weight, bias), moe)
    assert ids.tolist() == [[1]] and weights.tolist() == [[1.0]]


def test_swiglu_oai_clamps_as_gpt_oss():
    moe = _moe(activation="swiglu_oai", swiglu_limit=7.0, swiglu_alpha=1.702)
    gate = torch.tensor([[-20.0, 0.5, 9.0, 30.0]])
    up = torch.tensor([[-10.0, 0.25, 8.0, -3.0]])
    got = activate(torch.cat([gate, up], dim=-1), moe)
    for j, (g, u) in enumerate(zip(gate[0].tolist(), up[0].tolist(), strict=True)):
        g, u = min(g, 7.0), max(min(u, 7.0), -7.0)
        expect = (u + 1) * g / (1 + torch.exp(torch.tensor(-1.702 * g)).item())
        assert got[0, j].item() == pytest.approx(expect, rel=1e-6)
    assert torch.equal(activate(torch.cat([gate, up], -1), _moe()), torch.nn.functional.silu(gate) * up)


def test_grouped_experts_equal_the_plain_reference():
    from kvrelay.kernels.moe_reference import fused_experts_reference
    from kvrelay.model.linear_kernel import LinearKernel

    gen = torch.Generator().manual_seed(1)
    for activation, bias in (("silu", False), ("swiglu_oai", True)):
        moe = _moe(num_experts=5, top_k=2, activation=activation)
        w13, w2 = torch.randn(5, 16, 12, generator=gen), torch.randn(5, 12, 8, generator=gen) * 0.3
        b13 = torch.randn(5, 16, generator=gen) if bias else None
        b2 = torch.randn(5, 12, generator=gen) if bias else None
        x = torch.randn(9, 12, generator=gen)
        weights, ids = route(torch.randn(9, 5, generator=gen), moe)
        ids[3] = torch.tensor([4, 4])  # one token routed twice to one expert; expert 0..3 still used
        kernels = [(LinearKernel(w13[e], None if b13 is None else b13[e]),
                    LinearKernel(w2[e], None if b2 is None else b2[e])) for e in range(5)]
        got = experts_grouped(x, weights, ids, kernels, moe)
        want = fused_experts_reference(x, w13, w2, weights, ids, b_gate_up=b13, b_down=b2, activation=activation)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(experts_grouped(x[:0], weights[:0], ids[:0], kernels, moe), x[:0])


def test_moe_layer_through_the_triton_kernel_equals_the_cpu_path(family_dirs):
    """The CUDA path (`kernels.triton_moe`, here under the interpreter) on a loaded model's MoE layers."""
    for arch in ("qwen3-moe", "gpt-oss"):
        model = load_model(family_dirs[arch]).model
        layer = model.model.layers[1].ffn
        x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
        cpu = layer(x)
        layer.use_triton = True
        torch.testing.assert_close(layer(x), cpu, atol=1e-5, rtol=1e-5)


def test_configs_of_each_family_parse_as_transformers_builds_them():
    from transformers import GptOssConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
    gpt = ModelConfig.from_hf_dict(GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2).to_dict())
    assert gpt.layer_types == ("sliding_attention", "full_attention") * 2 and gpt.sliding_window_tokens == 128
    assert gpt.moe.routing == "topk_softmax" and gpt.moe.expert_bias and gpt.attention_sinks and gpt.qkv_bias
    q3 = ModelConfig.from_hf_dict(Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=16, decoder_sparse_step=2,
                                                 mlp_only_layers=[3]).to_dict())
    assert q3.moe.sparse_layers == (False, True, False, False) and q3.qk_norm and q3.sliding_window_tokens is None
    q3w = ModelConfig.from_hf_dict(Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                                  moe_intermediate_size=16, use_sliding_window=True,
                                                  sliding_window=64).to_dict())
    assert q3w.layer_windows == (64,) * 4
    q2 = ModelConfig.from_hf_dict(Qwen2Config(**common, use_sliding_window=True, sliding_window=64,
                                              max_window_layers=2).to_dict())
    assert q2.layer_windows == (None, None, 64, 64)
    mistral = ModelConfig.from_hf_dict(MistralConfig(**common, sliding_window=64).to_dict())
    assert mistral.layer_windows == (64,) * 4 and mistral.max_context_tokens == mistral.max_position_embeddings
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**GptOssConfig(**common).to_dict(), "num_experts_per_tok": 9,
                                  "num_local_experts": 4})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**GptOssConfig(**common).to_dict(), "layer_types": ["sliding_attention"]})


# ---- hybrid KV: the sliding layers' blocks are given back ----

def test_gpt_oss_sliding_blocks_out_of_the_window_go_back_to_the_pool_while_full_ones_stay(family_dirs):
    """gpt-oss (tiny: 2 full + 2 sliding layers, window 32) pages its KV in two groups: 16-token block i
    of a sequence is table entries 2i (full layers) and 2i + 1 (sliding layers). Before the decode step of
    row p, the sliding blocks wholly before p − 31 are given back; the full ones never are."""
    from kvrelay.engine.block_tables import NULL_BLOCK, held

    loaded = load_model(family_dirs["gpt-oss"])
    assert [g.window for g in loaded.config.kv_groups] == [None, TINY_WINDOW]
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_batched_tokens=128,
                                            enable_prefix_caching=False))
    assert engine.spec.num_groups == 2 and engine.spec.num_layers == 2
    prompt = _prompts((100,))[0]
    engine.add_request("r", prompt, GREEDY)
    seq = engine._requests["r"].seqs[0]
    seen = []
    while engine.has_unfinished():
        engine.step()
        if seq.status.value == "running":
            seen.append((seq.num_computed_tokens, list(seq.block_table), engine.pool.stats().num_in_use))
    for computed, table, in_use in seen:
        blocks = -(-computed // 16)  # 16-token blocks with KV so far
        last_decoded = computed - 1  # the row the last decode step wrote (the prefill step: the prompt)
        dropped = max(0, (last_decoded - TINY_WINDOW + 1) // 16) if computed > len(prompt) else 0
        assert len(table) == 2 * blocks, computed
        assert [table[2 * i + 1] == NULL_BLOCK for i in range(blocks)] == [i < dropped for i in range(blocks)]
        assert NULL_BLOCK not in table[0::2]  # the full layers keep every block
        assert in_use == len(held(table)) == 2 * blocks - dropped, computed
    final_computed, final_table, _ = seen[-1]
    assert final_computed == 100 + OUT_TOKENS - 2  # the step of the last token finishes the sequence
    # at 138 rows: 9 blocks of the full layers, 3 of the sliding layers (the window of row 137, rows
    # 106..137, spans blocks 6..8): 12 blocks where an all-full layout holds 18
    assert len(held(final_table)) == 12
    assert engine.pool.stats().num_in_use == 0
    engine.check_integrity()


def test_gpt_oss_samples_and_preemption_with_given_back_blocks_equal_single_runs(family_dirs):
    """n = 3 samples fork the prompt's blocks of both groups and copy on write each group's tail; in a pool
    too small for four sequences at once some are preempted and recomputed. Every stream equals its run
    alone, and the references add up after every step."""
    loaded = load_model(family_dirs["gpt-oss"])
    prompt, *others = _prompts((70, 70, 71, 100), seed=4)
    sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=40)
    [[alone]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], sampled)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=64))
    eng.add_request("n3", prompt, dataclasses.replace(sampled, n=3))
    seqs = eng._requests["n3"].seqs
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    outputs = [s.output_token_ids for s in seqs]
    assert outputs[0] == alone and len({tuple(o) for o in outputs}) == 3
    assert eng.pool.stats().num_in_use == 0

    greedy = SamplingParams(max_tokens=60, min_tokens=60)
    alone = [LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([p], greedy)[0][0] for p in others]
    small = LLMEngine(loaded, EngineConfig(num_blocks=24, max_num_seqs=8))
    assert [o[0] for o in small.generate(others, greedy)] == alone
    assert small.stats.preemptions > 0
    small.check_integrity()
    assert small.pool.stats().num_in_use == 0
