"""`write_tiny_model`: determinism, loadable by transformers, and output that is not a constant loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvrelay.model.attention import make_backend
from kvrelay.model.loader import load_model, model_fingerprint
from kvrelay.model.tiny import BOS_ID, EOS_ID, write_tiny_model
from kvrelay.model.tokenizer import load_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.model.paged_steps import PrefillPart, greedy_generate, make_batch, new_pool

FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
         "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


def test_same_seed_writes_identical_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again", seed=0)
    assert sorted(p.name for p in again.iterdir()) == FILES
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert model_fingerprint(again) == model_fingerprint(tiny_dir)


def test_different_seed_changes_weights_and_fingerprint(tiny_dir: Path, tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    assert model_fingerprint(other) != model_fingerprint(tiny_dir)


def test_config_is_classic_llama(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 10000.0 and "rope_parameters" not in config
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (258, BOS_ID, EOS_ID)


def test_options_shape_the_model(tmp_path: Path) -> None:
    loaded = load_model(write_tiny_model(tmp_path / "m", layers=3, hidden=96, heads=6, kv_heads=3, vocab=300,
                                         intermediate=200, max_position_embeddings=512))
    c = loaded.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (3, 96, 6, 3)
    assert (c.head_dim, c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (16, 300, 200, 512)
    with pytest.raises(ValueError, match="vocab must be at least 258"):
        write_tiny_model(tmp_path / "bad", vocab=100)


@torch.inference_mode()
def test_transformers_loads_it_and_agrees(tiny_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    ours = load_model(tiny_dir)
    prompt = load_tokenizer(tiny_dir).encode("The quick brown fox")
    expected = hf(torch.tensor([prompt])).logits[0]
    batch, positions = make_batch([PrefillPart([5, 2], 0, len(prompt))], [])
    pool = new_pool(ours.config, 6)
    got = ours.model.compute_logits(ours.model(torch.tensor(prompt), positions, pool, batch, make_backend("reference")))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=EOS_ID)[0, len(prompt):].tolist()
    assert greedy_generate(ours.model, prompt, 24) == hf_tokens


def test_greedy_output_is_not_a_constant_loop(tiny_dir: Path) -> None:
    model = load_model(tiny_dir).model
    for text in ["Hello", "a"]:
        tokens = greedy_generate(model, load_tokenizer(tiny_dir).encode(text), 64)
        assert len(set(tokens)) >= 8, tokens


def test_tokenizer_matches_transformers(tiny_dir: Path) -> None:
    ours = load_tokenizer(tiny_dir)
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    assert ours.encode("héllo") == [BOS_ID, *"héllo".encode()]
    assert ours.encode("héllo", add_special_tokens=False) == list("héllo".encode())
    for text in ["héllo", "", " leading space", "emoji 😀 and\nnewline\t", "stop </s> inside"]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text.replace("</s>", "")
    assert ours.decode([BOS_ID, 104, 105, EOS_ID], skip_special_tokens=False) == "<s>hi</s>"
    assert ours.eos_token_ids == (EOS_ID,)


def test_chat_template_renders_like_transformers(tiny_dir: Path) -> None:
    ours = load_tokenizer(tiny_dir)
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == "<s><|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    without = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert without == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = ours.encode(rendered, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
