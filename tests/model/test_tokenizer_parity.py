"""`model.tokenizer` encodes and decodes exactly as `transformers.AutoTokenizer`, on generated text.

Three tokenizers: SmolLM2's (as `kvrelay model pull` writes it, and as transformers reads it from the
GGUF itself), and a Llama-3-style and a Qwen2-style ``tokenizer.json`` trained here with `tokenizers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvrelay.model.stream_decoder import stream_decoder
from kvrelay.model.tokenizer import load_tokenizer
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from tests.real_model import RealModel

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello, world! 1234567890 café naïve Straße",
          "def f(x):\n    return x * 2  # comment\n", "日本語のテキスト、中文文本。",
          "emoji 😀🎉 and tabs\tand  spaces"]
SPECIAL_PIECES = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>",
                  "<|endoftext|>", "<repo_name>"]
TEXT = st.lists(
    st.one_of(st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
              st.sampled_from(["  ", "\n\n", "\t", " 2024", "café", "😀", "'s", "ﬁ", "e\u0301"]),
              st.sampled_from(SPECIAL_PIECES)),
    max_size=8,
).map("".join)


def _trained(split: str, specials: list[str], *, bos: str | None, nfc: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def _write(out: Path, tok: Tokenizer, config: dict) -> Path:
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return out


@pytest.fixture(scope="module")
def tokenizer_dirs(smollm2: RealModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    llama3 = _trained(LLAMA3_SPLIT, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                      bos="<|begin_of_text|>", nfc=False)
    qwen2 = _trained(QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, nfc=True)
    return {
        "smollm2": smollm2.model_dir,
        "llama3-bos": _write(root / "llama3", llama3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
        "qwen2-no-bos": _write(root / "qwen2", qwen2, {"bos_token": None, "eos_token": "<|im_end|>",
                                                      "pad_token": "<|endoftext|>"}),
    }


@pytest.mark.parametrize("name", ["smollm2", "llama3-bos", "qwen2-no-bos"])
def test_ids_and_text_equal_transformers(tokenizer_dirs: dict[str, Path], name: str) -> None:
    ours, hf = load_tokenizer(tokenizer_dirs[name]), AutoTokenizer.from_pretrained(tokenizer_dirs[name])
    adds_bos = hf("x").input_ids != hf("x", add_special_tokens=False).input_ids
    assert adds_bos == (name == "llama3-bos")

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(TEXT)
    def check(text: str) -> None:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)

    check()


def test_smollm2_tokenizer_equals_transformers_gguf_reader(smollm2: RealModel) -> None:
    """The converted tokenizer.json tokenizes as transformers' own reading of the GGUF does."""
    ours = load_tokenizer(smollm2.model_dir)
    hf = AutoTokenizer.from_pretrained(smollm2.gguf_dir, gguf_file=smollm2.gguf_file)

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(TEXT)
    def check(text: str) -> None:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)

    check()
    messages = [{"role": "user", "content": "Hi 😀"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(rendered, add_special_tokens=False) == hf.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_streamed_text_equals_decode_of_the_whole_output(smollm2: RealModel) -> None:
    """Token by token, multi-byte characters split across byte-level tokens included."""
    tok = load_tokenizer(smollm2.model_dir)

    @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(TEXT)
    def check(text: str) -> None:
        ids = tok.encode(text)
        stream = stream_decoder(tok)
        streamed = "".join(stream.push([i]) for i in ids) + stream.flush()
        assert streamed == tok.decode(ids)

    check()
    ids = tok.encode("日本語 😀🎉 naïve")
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some token holds only part of a character
