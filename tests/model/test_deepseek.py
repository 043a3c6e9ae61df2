"""DeepSeek-V2/V3 (`model.deepseek`): the latent KV layout, the absorbed attention against transformers' unabsorbed
math and through the Triton kernels, group-limited routing exactly as transformers routes, and the config
fields read as transformers reads them. Greedy tokens against transformers, through ``kvrelay generate`` and a
1P1D ``kvrelay up`` are in tests/model/test_families.py and tests/services/test_families_serving.py (the
``deepseek-v3`` tiny arch)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.model.config import ModelConfig
from kvrelay.model.deepseek import DeepseekMoe, MlaAttention, route_grouped
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tiny import write_tiny_model

PROMPTS = [[random.Random(s).randrange(256) for _ in range(n)] for s, n in ((1, 300), (2, 37), (3, 16), (4, 1))]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ds") / "model", arch="deepseek-v3", layers=4)


def _tokens(model_dir: Path, prompts: list[list[int]] = PROMPTS, **engine: object) -> list[list[int]]:
    eng = LLMEngine(load_model(model_dir), EngineConfig(num_blocks=96, max_num_batched_tokens=64, **engine))
    out = [o[0] for o in eng.generate(prompts, GREEDY)]
    eng.check_integrity()
    assert eng.pool.stats().num_in_use == 0
    return out


def test_the_cache_holds_one_latent_row_per_token_and_layer(ds_dir):
    loaded = load_model(ds_dir)
    cfg = loaded.config
    assert cfg.mla is not None and cfg.kv_planes == (1, 1, 32 + 8)
    spec = LLMEngine.block_spec_for(loaded, 16)
    assert (spec.num_planes, spec.num_kv_heads, spec.head_dim, spec.num_layers) == (1, 1, 40, 4)
    assert spec.block_bytes == 4 * 40 * 16 * 4  # a GQA layout of 4 heads of 16 would be 2 * 4 * 4 * 16 * 16 * 4
    dense_spec = LLMEngine.block_spec_for(load_model(write_tiny_model(ds_dir.parent / "llama", layers=4)), 16)
    assert spec.fingerprint != dense_spec.fingerprint
    layers = loaded.model.model.layers
    assert [type(layer.ffn).__name__ for layer in layers] == ["MLP", "MLP", "DeepseekMoe", "DeepseekMoe"]
    assert all(isinstance(layer.self_attn, MlaAttention) for layer in layers)


def test_either_way_of_attending_gives_the_same_tokens(ds_dir):
    """Every layer switched from the default (absorbed decode, expanded prefill) to the other way of each
    (`MlaAttention.absorbed_decode`, `absorbed_prefill`): batched prefill chunks with prefix hits and decode,
    the same greedy tokens."""
    loaded = load_model(ds_dir)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=96, max_num_batched_tokens=64))
    default = [o[0] for o in eng.generate(PROMPTS, GREEDY)]
    for layer in loaded.model.model.layers:
        layer.self_attn.absorbed_decode, layer.self_attn.absorbed_prefill = False, True
    assert [o[0] for o in eng.generate(PROMPTS, GREEDY)] == default


def test_one_layer_absorbed_equals_unabsorbed_within_1e_5(ds_dir):
    """One decoder layer's attention output over a step with prefill chunks (one after a cached prefix) and
    decode tokens: absorbed decode and expanded prefill (the default), the other way of each, and both unabsorbed
    through the oracle (`kernels.reference.mla_unabsorbed_attention`)."""
    from kvrelay.model.attention import AttentionBatch, make_backend

    loaded = load_model(ds_dir)
    attn = loaded.model.model.layers[2].self_attn
    rank, width = 32, 40
    gen = torch.Generator().manual_seed(0)
    pool = torch.zeros(12, 1, 1, 16, width)
    # sequence 0: 20 cached + 13 new (prefill); sequence 1: 5 new (prefill); sequences 2, 3: decode at 40 and 17
    prefill_lens, new = [33, 5], [13, 5]
    decode_lens = [40, 17]
    tables = torch.tensor([[0, 1, 2], [3, 9, 9], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    positions = [*range(20, 33), *range(5), 39, 16]
    slots = [int(tables[0, p // 16]) * 16 + p % 16 for p in range(20, 33)] + [3 * 16 + p for p in range(5)]
    slots += [int(tables[2, 39 // 16]) * 16 + 39 % 16, int(tables[3, 1]) * 16 + 0]
    pool[:, 0, 0].copy_(torch.randn(12, 16, width, generator=gen))  # the cached rows
    batch = AttentionBatch(
        slot_mapping=torch.tensor(slots), num_prefill_tokens=18, prefill_block_tables=tables[:2],
        prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.int32),
        prefill_query_start_loc=torch.tensor([0, new[0], sum(new)], dtype=torch.int32),
        decode_block_tables=tables[2:], decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32))
    x = torch.randn(len(slots), loaded.config.hidden_size, generator=gen)
    cos_sin = loaded.model.rotary(torch.tensor(positions), torch.float32)
    outs = []
    for absorbed_decode, absorbed_prefill in ((True, False), (False, True), (True, True)):
        attn.absorbed_decode, attn.absorbed_prefill = absorbed_decode, absorbed_prefill
        layer_pool = pool.clone()
        outs.append(attn(x, cos_sin, layer_pool, batch, make_backend("torch")))
        assert not torch.equal(layer_pool, pool)  # the new rows were written
    attn.absorbed_decode, attn.absorbed_prefill = True, False
    for other in outs[1:]:
        assert (outs[0] - other).abs().max().item() <= 1e-5
    assert rank < width


def test_the_triton_backend_gives_the_reference_tokens(ds_dir):
    """Decode through `kernels.triton_mla` (300 tokens: two splits) and the latent write through the Triton
    KV-write kernel, under Triton's interpreter: the reference backend's tokens."""
    prompts = PROMPTS[:2]
    assert _tokens(ds_dir, prompts, attention_backend="triton") == _tokens(ds_dir, prompts,
                                                                           attention_backend="reference")


def test_long_context_policies_are_refused_with_the_reason(ds_dir):
    with pytest.raises((ValueError, RequestError), match="multi-head latent attention"):
        LLMEngine(load_model(ds_dir), EngineConfig(num_blocks=64, long_context=LongContextConfig(policy="h2o")))


def _hf_router(cls_name: str, **kw: object):
    import transformers

    config = getattr(transformers, cls_name.replace("TopkRouter", "Config"))(
        hidden_size=16, num_attention_heads=2, **kw)
    module = transformers.models.deepseek_v3.modeling_deepseek_v3 if "V3" in cls_name else \
        transformers.models.deepseek_v2.modeling_deepseek_v2
    return config, getattr(module, cls_name)(config)


@pytest.mark.parametrize("kind", ["v3", "v2-greedy", "v2-group-limited"])
def test_group_limited_routing_equals_transformers(kind):
    torch.manual_seed(0)
    if kind == "v3":
        config, hf = _hf_router("DeepseekV3TopkRouter", n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
        hf.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
        model_type = "deepseek_v3"
    else:
        method = "greedy" if kind == "v2-greedy" else "group_limited_greedy"
        config, hf = _hf_router("DeepseekV2TopkRouter", n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                topk_group=2, routed_scaling_factor=16.0, topk_method=method)
        model_type = "deepseek_v2"
    hf.weight.data.normal_()
    cfg = ModelConfig.from_hf_dict({**config.to_dict(), "model_type": model_type})
    assert cfg.moe is not None
    x = torch.randn(64, 16)
    _, want_w, want_ids = hf(x)
    bias = hf.e_score_correction_bias if kind == "v3" else None
    got_w, got_ids = route_grouped(torch.nn.functional.linear(x, hf.weight), cfg.moe, bias)
    order_w, order_g = want_ids.sort(dim=-1), got_ids.sort(dim=-1)
    assert torch.equal(order_w.values, order_g.values)
    assert torch.allclose(want_w.gather(1, order_w.indices), got_w.gather(1, order_g.indices), atol=0, rtol=0)
    if kind == "v2-group-limited":  # the chosen experts lie in at most topk_group groups
        assert all(len(set((ids // 4).tolist())) <= 2 for ids in got_ids)


def test_deepseek_config_fields_read_as_transformers_reads_them():
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=5, q_lora_rank=None,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=3,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                           "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707})
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    assert cfg.mla.softmax_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
    assert (cfg.mla.q_lora_rank, cfg.head_dim, cfg.num_key_value_heads) == (None, 8, 4)
    assert cfg.moe.sparse_layers == (False, False, False, True, True)
    assert (cfg.moe.num_groups, cfg.moe.topk_group, cfg.moe.shared_intermediate_size) == (2, 1, 2048)
    with pytest.raises(ValueError, match="n_group .* must divide"):
        ModelConfig.from_hf_dict({**hf.to_dict(), "n_group": 3})


def test_a_deepseek_moe_layer_adds_its_shared_experts(ds_dir):
    loaded = load_model(ds_dir)
    moe = loaded.model.model.layers[3].ffn
    assert isinstance(moe, DeepseekMoe) and moe.shared_experts is not None
    x = torch.randn(5, loaded.config.hidden_size)
    with_shared = moe(x)
    shared, moe.shared_experts = moe.shared_experts, None
    try:
        assert torch.allclose(with_shared - moe(x), shared(x), atol=1e-6)
    finally:
        moe.shared_experts = shared


ISSUE_LENGTHS = (1, 16, 17, 100, 300)


def test_greedy_tokens_equal_transformers_through_kvrelay_generate_and_a_1p1d_request(ds_dir, tmp_path):
    """Prompt lengths 1, 16, 17, 100 and 300: transformers' greedy tokens (float32, eager) from ``kvrelay generate``
    and from a ``kvrelay up`` request whose prompt KV the decode node pulls from the prefill node over NIXL (served
    without tokenizer.json: the completion names each token ``token_id:N``)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from tests.model.test_families import OUT_TOKENS, _hf_greedy, _prompts
    from tests.services.cluster import Cluster
    from tests.services.test_families_serving import complete

    prompts = _prompts(ISSUE_LENGTHS, seed=4)
    runs = [subprocess.Popen(
        [sys.executable, "-m", "kvrelay.deploy.cli", "generate", "--model", str(ds_dir), "--prompt-ids",
         ",".join(map(str, p)),
         "--max-tokens", str(OUT_TOKENS), "--min-tokens", str(OUT_TOKENS), "--dtype", "float32", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    ) for p in prompts]
    try:
        expected = _hf_greedy(ds_dir, prompts)
        assert len({tuple(e) for e in expected}) == len(prompts)
        for n, proc, want in zip(ISSUE_LENGTHS, runs, expected, strict=True):
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-2000:]
            assert json.loads(stdout)["token_ids"] == want, f"kvrelay generate, prompt length {n}"
    finally:
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    served = shutil.copytree(ds_dir, tmp_path / "model")
    (served / "tokenizer.json").unlink()
    with Cluster(served) as c:
        for n, prompt, want in zip(ISSUE_LENGTHS, prompts, expected, strict=True):
            assert complete(c.url, prompt) == want, f"1P1D, prompt length {n}"


def test_a_deepseek_moe_layer_through_the_triton_fused_experts_equals_the_grouped_cpu_path(ds_dir):
    """What a CUDA deployment runs (`kernels.triton_moe.fused_experts`, here under Triton's interpreter) against
    the grouped CPU experts, shared experts included."""
    loaded = load_model(ds_dir)
    moe = loaded.model.model.layers[2].ffn
    x = torch.randn(9, loaded.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cpu = moe(x)
    moe.prepare(use_triton=True)
    try:
        assert (moe(x) - cpu).abs().max().item() <= 1e-5
    finally:
        moe.prepare(use_triton=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_engine_gives_the_cpu_reference_tokens(ds_dir):
    """On CUDA: compiled Triton kernels (`kernels.triton_mla` decode, the unified kernel's prefill is not used:
    prefill expands), the fused-MoE kernel, and decode steps replayed from CUDA graphs; float32 greedy tokens equal
    the CPU reference backend's."""
    gpu = LLMEngine(load_model(ds_dir, dtype="float32", device="cuda"),
                    EngineConfig(num_blocks=96, attention_backend="triton", max_num_batched_tokens=64))
    assert gpu.kv_pool.device.type == "cuda" and gpu.cuda_graph_sizes  # the MLA decode step was captured
    assert [o[0] for o in gpu.generate(PROMPTS, GREEDY)] == _tokens(ds_dir, attention_backend="reference")


def test_the_router_stays_float32_in_a_bf16_model_and_fp8_checkpoints_are_refused(ds_dir, tmp_path):
    """transformers keeps DeepSeek's router in float32 (its correction bias picks the experts, and bf16 rounding
    of it would change the choice); FP8 checkpoints (block scales ``*_scale_inv``) are refused, not mis-read."""
    import shutil

    from safetensors.torch import load_file, save_file

    loaded = load_model(ds_dir, dtype="bfloat16")
    gate = loaded.model.model.layers[3].mlp.gate
    stored = load_file(str(ds_dir / "model.safetensors"))
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, stored["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert loaded.model.model.layers[3].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    fp8 = shutil.copytree(ds_dir, tmp_path / "fp8")
    save_file({**stored, "model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 1)},
              str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match="FP8 with block scales .*'model.layers.0.self_attn.q_a_proj.weight_scale_inv'"
                                         ".*convert the checkpoint to bf16"):
        load_model(fp8)


@pytest.mark.parametrize("version", ["V3", "V2"])
def test_absent_moe_keys_take_transformers_defaults(version):
    import transformers

    minimal = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None,
                   num_experts_per_tok=2)
    model_type = f"deepseek_{version.lower()}"
    ours = ModelConfig.from_hf_dict({"model_type": model_type, **minimal})
    hf = ModelConfig.from_hf_dict(getattr(transformers, f"Deepseek{version}Config")(**minimal).to_dict())
    assert ours.moe == hf.moe and ours.mla == hf.mla
