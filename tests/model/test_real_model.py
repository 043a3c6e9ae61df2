"""SmolLM2-135M-Instruct as `kvrelay model pull` writes it equals transformers loading the GGUF itself."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.attention import make_backend
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.model.paged_steps import BLOCK_SIZE, PrefillPart, make_batch, new_pool
from tests.real_model import RealModel

NEW_TOKENS = 48
LOGIT_TOLERANCE = 1e-3
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "In 2024, 3 + 4 = 7 and 12 × 12 = 144; héllo 🌍"]
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def reference(smollm2: RealModel) -> AutoModelForCausalLM:
    """transformers' own GGUF loader (de-quantizes to float32)."""
    model = AutoModelForCausalLM.from_pretrained(smollm2.gguf_dir, gguf_file=smollm2.gguf_file, dtype=torch.float32)
    return model.eval()


def test_pulled_directory_describes_the_model(smollm2: RealModel) -> None:
    config = json.loads((smollm2.model_dir / "config.json").read_text())
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps")} == {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
    marker = json.loads((smollm2.model_dir / "kvrelay-pull.json").read_text())
    assert (marker["dtype"], marker["license"]) == ("float32", "Apache-2.0")


def test_greedy_tokens_and_logits_equal_transformers_gguf(smollm2: RealModel, reference: AutoModelForCausalLM) -> None:
    hf_tok = AutoTokenizer.from_pretrained(smollm2.gguf_dir, gguf_file=smollm2.gguf_file)
    prompts = [hf_tok(p).input_ids for p in PROMPTS]
    prompts.append(hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"])
    ours_tok = load_tokenizer(smollm2.model_dir)
    assert [ours_tok.encode(p) for p in PROMPTS] == prompts[:3]
    assert ours_tok.encode(ours_tok.apply_chat_template(CHAT), add_special_tokens=False) == prompts[3]

    loaded = load_model(smollm2.model_dir, dtype="float32")
    with torch.inference_mode():
        for ids in prompts:
            pool = new_pool(loaded.config, -(-len(ids) // BLOCK_SIZE))
            batch, positions = make_batch([PrefillPart(list(range(pool.shape[0])), 0, len(ids))], [])
            hidden = loaded.model(torch.tensor(ids), positions, pool, batch, make_backend("reference"))
            torch.testing.assert_close(loaded.model.compute_logits(hidden), reference(torch.tensor([ids])).logits[0],
                                       atol=LOGIT_TOLERANCE, rtol=0)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=256))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for ids, [got] in zip(prompts, outputs):
        assert got == _greedy(reference, ids, NEW_TOKENS), ours_tok.decode(ids)


@torch.inference_mode()
def _greedy(model: AutoModelForCausalLM, ids: list[int], n: int) -> list[int]:
    """``n`` argmax tokens past any EOS (``generate`` would stop there, or mask EOS with min_new_tokens); each
    step feeds the last token with transformers' own KV cache, not the whole sequence again."""
    from transformers import DynamicCache

    # transformers 5.2x names the argument ``cache``; 4.x ``past_key_values`` (pyproject allows both).
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {arg: DynamicCache()}
    logits = model(torch.tensor([ids]), use_cache=True, **cache).logits
    tokens = [int(logits[0, -1].argmax())]
    for _ in range(n - 1):
        logits = model(torch.tensor([tokens[-1:]]), use_cache=True, **cache).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens
