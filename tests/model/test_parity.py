"""Logit parity with transformers' eager implementation, for checkpoints transformers writes itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvrelay.model.attention import make_backend
from kvrelay.model.loader import LoadedModel, load_model
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from tests.model.paged_steps import DecodePart, PrefillPart, make_batch, new_pool, shuffled_block_table

TOLERANCE = 1e-4
VOCAB = 300


def _hf_configs() -> dict[str, PretrainedConfig]:
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=1024)
    return {
        "llama_gqa4_llama3": LlamaConfig(
            **common, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 128},
        ),
        "qwen2_bias_tied": Qwen2Config(
            **common, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        "mistral": MistralConfig(
            **common, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
            sliding_window=512,
        ),
        "mistral_window_24": MistralConfig(  # every layer slides; the prompts reach past the window
            **common, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            sliding_window=24,
        ),
        "qwen2_window_on_the_upper_layers": Qwen2Config(  # 1 full + 2 sliding layers: one KV block group
            **{**common, "num_hidden_layers": 3}, hidden_size=64, intermediate_size=160, num_attention_heads=4,
            num_key_value_heads=2, use_sliding_window=True, sliding_window=20, max_window_layers=1,
        ),
        "llama_head_dim_linear_bias": LlamaConfig(
            **common, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
        ),
    }


def _spread_init(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' init (std 0.02, unit norms, zero biases) so that every tensor matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


@pytest.fixture(scope="module", params=sorted(_hf_configs()))
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, LoadedModel]:
    """A transformers model (eager attention) and ours loaded from its ``save_pretrained`` directory."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_hf_configs()[request.param], attn_implementation="eager")
    _spread_init(hf, seed=1)
    hf.eval()
    out_dir: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out_dir)
    return hf, load_model(out_dir)


def _prompt(n: int, seed: int = 2) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=["reference", "torch"])
def backend_name(request) -> str:
    """Both CPU attention backends: the plain reference and the batched SDPA serving path."""
    return request.param


@pytest.mark.parametrize("prompt_len", [1, 16, 17, 300])
@torch.inference_mode()
def test_prefill_logits_match_transformers(pair, prompt_len: int, backend_name: str) -> None:
    hf, ours = pair
    ids = _prompt(prompt_len)
    pool = new_pool(ours.config, 40)
    table = shuffled_block_table(prompt_len, num_blocks=40, seed=prompt_len)
    batch, positions = make_batch([PrefillPart(table, 0, prompt_len)], [])
    hidden = ours.model(torch.tensor(ids), positions, pool, batch, make_backend(backend_name))
    logits = ours.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (prompt_len, VOCAB)
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=TOLERANCE, rtol=0)


@torch.inference_mode()
def test_chunked_prefill_then_decode_match_transformers(pair, backend_name: str) -> None:
    """Prefill 20 tokens, then 13 more over the cached prefix, then decode one token."""
    hf, ours = pair
    ids = _prompt(34, seed=3)
    expected = _hf_logits(hf, ids)
    backend = make_backend(backend_name)
    pool = new_pool(ours.config, 8)
    table = shuffled_block_table(34, num_blocks=8, seed=4)
    got = []
    for part in (PrefillPart(table, 0, 20), PrefillPart(table, 20, 13)):
        batch, positions = make_batch([part], [])
        chunk = torch.tensor(ids[part.ctx_len : part.ctx_len + part.num_new])
        got.append(ours.model.compute_logits(ours.model(chunk, positions, pool, batch, backend)))
    batch, positions = make_batch([], [DecodePart(table, 34)])
    assert batch.num_prefill_tokens == 0 and positions.tolist() == [33]
    got.append(ours.model.compute_logits(ours.model(torch.tensor(ids[33:]), positions, pool, batch, backend)))
    torch.testing.assert_close(torch.cat(got), expected, atol=TOLERANCE, rtol=0)


@torch.inference_mode()
def test_mixed_prefill_and_decode_step_matches_transformers(pair, backend_name: str) -> None:
    """One step holding a fresh 17-token prefill and a decode token of another sequence."""
    hf, ours = pair
    a, b = _prompt(17, seed=5), _prompt(24, seed=6)
    backend = make_backend(backend_name)
    pool = new_pool(ours.config, 12)
    table_a, table_b = [3, 9], [11, 0]
    batch, positions = make_batch([PrefillPart(table_b, 0, 23)], [])
    ours.model(torch.tensor(b[:23]), positions, pool, batch, backend)
    batch, positions = make_batch([PrefillPart(table_a, 0, 17)], [DecodePart(table_b, 24)])
    assert positions.tolist() == [*range(17), 23]
    logits = ours.model.compute_logits(ours.model(torch.tensor(a + b[23:]), positions, pool, batch, backend))
    torch.testing.assert_close(logits[:17], _hf_logits(hf, a), atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits[17:], _hf_logits(hf, b)[23:], atol=TOLERANCE, rtol=0)


def test_loaded_model_is_frozen_and_tied_as_configured(pair) -> None:
    hf, ours = pair
    model = ours.model
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    hf_names = set(hf.state_dict())
    ours_names = set(dict(model.named_parameters(remove_duplicate=False)))
    assert ours_names == hf_names


