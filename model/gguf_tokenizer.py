"""A GGUF file's tokenizer as a Hugging Face ``tokenizer.json`` (built with the `tokenizers` library).

Supported: byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) with the
pre-tokenizers named in `PRE_TOKENIZER_SPLITS_DIGITS` (llama.cpp's ``tokenizer.ggml.pre``). What is
built mirrors the checkpoint the GGUF came from:

* model: BPE over ``tokenizer.ggml.tokens`` / ``merges``, no unknown token, no byte fallback;
* pre-tokenizer: GPT-2's regex split and byte-to-unicode map (``ByteLevel``), preceded by a
  one-digit split (``Digits(individual_digits=True)``) for the StarCoder-family vocabularies
  (SmolLM's among them) that were trained with it;
* post-processor: adds BOS / EOS only when ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``
  say so (SmolLM2 adds neither);
* added tokens: every CONTROL token is special (never split, skipped by
  ``decode(skip_special_tokens=True)``); USER_DEFINED tokens are added, not special.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# tokenizer.ggml.pre → does it split digits one by one before the byte-level regex?
PRE_TOKENIZER_SPLITS_DIGITS: dict[str, bool] = {
    "default": False,
    "gpt2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
}
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
_MISSING = object()


class GgufError(ValueError):
    """A GGUF file that cannot be converted; the message names the file part and what to do."""


def read_field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata ``key`` of a ``gguf.GGUFReader``; ``default`` when absent.

    Raises:
        GgufError: ``key`` is absent and no default was given.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise GgufError(f"the GGUF has no {key!r} metadata")
        return default
    return field.contents()


def build_tokenizer(reader: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a GGUF (see module doc).

    Raises:
        GgufError: not a byte-level BPE vocabulary, an unknown pre-tokenizer, or inconsistent lists.
    """
    kind = read_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    pre = read_field(reader, "tokenizer.ggml.pre", default="default")
    if pre not in PRE_TOKENIZER_SPLITS_DIGITS:
        raise GgufError(f"GGUF pre-tokenizer {pre!r} is not supported; "
                        f"supported: {sorted(PRE_TOKENIZER_SPLITS_DIGITS)}")
    tokens: list[str] = read_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = read_field(reader, "tokenizer.ggml.token_type")
    merges: list[str] = read_field(reader, "tokenizer.ggml.merges")
    if len(types) != len(tokens):
        raise GgufError(f"the GGUF lists {len(tokens)} tokens but {len(types)} token types")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GgufError("the GGUF vocabulary lists a token twice")
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise GgufError("a GGUF merge is not two tokens separated by one space")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(read_field(reader, "tokenizer.ggml.add_space_prefix", default=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if PRE_TOKENIZER_SPLITS_DIGITS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=(k == TOKEN_TYPE_CONTROL), normalized=False)
                    for t, k in zip(tokens, types) if k in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)])
    tok.post_processor = _post_processor(reader, tokens)
    return tok


def _post_processor(reader: Any, tokens: list[str]) -> Any:
    add = [(name, read_field(reader, f"tokenizer.ggml.{name}_token_id", default=None))
           for name in ("bos", "eos") if read_field(reader, f"tokenizer.ggml.add_{name}_token", default=False)]
    if not add:
        return processors.ByteLevel(trim_offsets=False)
    for name, token_id in add:
        if token_id is None:
            raise GgufError(f"the GGUF asks to add a {name.upper()} token but names no tokenizer.ggml.{name}_token_id")
    specials = {name: tokens[int(token_id)] for name, token_id in add}
    bos = [specials["bos"]] if "bos" in specials else []
    eos = [specials["eos"]] if "eos" in specials else []
    single = " ".join([*bos, "$A", *eos])
    pair = " ".join([*bos, "$A", *eos, *bos, "$B:1", *eos])
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(tokens[int(i)], int(i)) for _, i in add])


def tokenizer_config(reader: Any, *, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` contents: special token strings and how encoding adds them."""
    tokens: list[str] = read_field(reader, "tokenizer.ggml.tokens")
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = read_field(reader, f"tokenizer.ggml.{key}", default=None)
        if token_id is not None:
            if not 0 <= int(token_id) < len(tokens):
                raise GgufError(f"tokenizer.ggml.{key} = {token_id} is outside the vocabulary of {len(tokens)}")
            out[name] = tokens[int(token_id)]
    out["add_bos_token"] = bool(read_field(reader, "tokenizer.ggml.add_bos_token", default=False))
    out["add_eos_token"] = bool(read_field(reader, "tokenizer.ggml.add_eos_token", default=False))
    out["add_prefix_space"] = bool(read_field(reader, "tokenizer.ggml.add_space_prefix", default=False))
    out["clean_up_tokenization_spaces"] = False
    out["model_max_length"] = model_max_length
    return out
