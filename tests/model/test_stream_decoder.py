"""`stream_decoder`: streamed deltas equal ``decode`` of all the ids, with work linear in the ids.

Issue 30 (3 of 9): while the text ended in U+FFFD the old decoder re-decoded every id since the last
complete character, per push; 2,000 forced continuation bytes took 2,003,000 decoded ids and every
delta was empty until the flush. Tokenizers: the tiny model's byte-level one (one token per byte),
SmolLM2's byte-level BPE (multi-byte tokens that split characters), and two SentencePiece-style
byte-fallback ones trained here (Llama 2's decoder, which strips a leading space, and Gemma's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvrelay.model.stream_decoder import MAX_HELD_IDS, stream_decoder
from kvrelay.model.tokenizer import Tokenizer, load_tokenizer
from kvrelay.router.text_output import SampleText
from tokenizers import AddedToken, decoders, models, normalizers, trainers

from tests.real_model import RealModel

CONTINUATION = 0x80  # the tiny tokenizer's id 128: UTF-8 byte 0x80, which never starts a character
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x * 2  # comment\n",
          "Hello, world! 1234567890 and some more plain words to merge"]
TEXT = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=6)


class Work:
    """Counts what a stream decoder asks of a tokenizer: ids given to ``decode``, per call, and
    ``token_bytes`` lookups (the instance's methods wrapped; the tokenizer itself is real)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode_calls: list[int] = []
        self.byte_lookups = 0
        decode, token_bytes = tok.decode, tok.token_bytes

        def counted_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
            self.decode_calls.append(len(ids))
            return decode(ids, skip_special_tokens)

        def counted_token_bytes(token_id: int) -> bytes:
            self.byte_lookups += 1
            return token_bytes(token_id)

        tok.decode = counted_decode  # type: ignore[method-assign]
        tok.token_bytes = counted_token_bytes  # type: ignore[method-assign]


def streamed(tok: Tokenizer, pushes: list[list[int]], *, skip: bool = True) -> list[str]:
    """The deltas of each push, then the flush."""
    decoder = stream_decoder(tok, skip_special_tokens=skip)
    return [decoder.push(ids) for ids in pushes] + [decoder.flush()]


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """``ids`` cut into pushes of the given sizes (cycled), as a decode node's deltas may carry several."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_with_added(tiny_model_dir: Path) -> Tokenizer:
    """The tiny tokenizer plus added tokens whose text ByteLevel cannot map ("日x") or maps to a lone
    byte ("é" is the alphabet's character for 0xE9), and a special one."""
    raw = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    raw.add_tokens([AddedToken("é", special=False), AddedToken("日x", special=False)])
    raw.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    return Tokenizer(raw, special_tokens={}, eos_token_ids=(), chat_template=None)


@dataclass(frozen=True)
class ByteFallback:
    """A byte-fallback tokenizer and the ids of its byte tokens."""

    tok: Tokenizer
    byte_ids: list[int]  # byte_ids[b]: the id of token ``<0xXX>``

    def of(self, data: bytes) -> list[int]:
        return [self.byte_ids[b] for b in data]


def _byte_fallback(decoder: decoders.Decoder) -> ByteFallback:
    """A SentencePiece-style BPE (▁ for spaces, ``<0xXX>`` tokens for bytes it has no token for),
    as Llama 2's / Gemma's ``tokenizer.json`` are written."""
    raw = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60, show_progress=False))
    spec = json.loads(raw.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    raw = tokenizers.Tokenizer.from_str(json.dumps(spec))
    raw.decoder = decoder
    tok = Tokenizer(raw, special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, eos_token_ids=(2,),
                    chat_template=None)
    out = ByteFallback(tok, [raw.token_to_id(f"<0x{b:02X}>") for b in range(256)])
    assert not tok.byte_level and tok.encode("日", add_special_tokens=False)[-3:] == out.of("日".encode())
    return out


LLAMA2_DECODER = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
GEMMA_DECODER = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])


@pytest.fixture(scope="module", params=["llama2", "gemma"])
def byte_fallback(request: pytest.FixtureRequest) -> ByteFallback:
    return _byte_fallback({"llama2": LLAMA2_DECODER, "gemma": GEMMA_DECODER}[request.param])


def any_ids(vocab: int, hot: list[int]) -> st.SearchStrategy[list[int]]:
    """Any ids, with runs of the ``hot`` ones (continuation and lead bytes) mixed in."""
    one = st.one_of(st.integers(0, vocab - 1), st.sampled_from(hot))
    return st.lists(st.one_of(one.map(lambda i: [i]), st.tuples(st.sampled_from(hot), st.integers(1, 9)).map(
        lambda t: [t[0]] * t[1])), max_size=40).map(lambda runs: [i for run in runs for i in run])


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_stream_equals_decode_for_any_ids(tiny: Tokenizer, tiny_with_added: Tokenizer, skip: bool) -> None:
    hot = [CONTINUATION, 0xBF, 0xC3, 0xE6, 0xF0, 0xED, 0xFF, 256, 257]

    @SETTINGS
    @given(st.sampled_from([tiny, tiny_with_added]), st.data(), st.lists(st.integers(1, 5), max_size=4))
    def check(tok: Tokenizer, data: st.DataObject, sizes: list[int]) -> None:
        ids = data.draw(any_ids(tok.vocab_size + 2, hot + list(range(258, tok.vocab_size))))  # + unknown ids
        assert "".join(streamed(tok, chunked(ids, sizes), skip=skip)) == tok.decode(ids, skip)

    check()


def test_smollm2_stream_equals_decode_for_any_ids(smollm2: RealModel) -> None:
    """Multi-byte tokens that hold a character's end and the next one's start included."""
    tok = load_tokenizer(smollm2.model_dir)
    assert tok.byte_level
    # ids whose bytes start or end inside a character (so a character spans two or more ids)
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i], False)][:400]
    assert len(partial) > 50

    @SETTINGS
    @given(any_ids(tok.vocab_size, partial), st.lists(st.integers(1, 4), max_size=3), st.booleans())
    def check(ids: list[int], sizes: list[int], skip: bool) -> None:
        assert "".join(streamed(tok, chunked(ids, sizes), skip=skip)) == tok.decode(ids, skip)

    check()


def test_byte_fallback_stream_equals_decode_where_byte_runs_are_well_formed(byte_fallback: ByteFallback) -> None:
    tok = byte_fallback.tok
    words = sorted(set(range(tok.vocab_size)) - set(byte_fallback.byte_ids) - {1, 2})
    piece = st.one_of(st.sampled_from(words).map(lambda i: [i]), st.sampled_from([1, 2]).map(lambda i: [i]),
                      TEXT.map(lambda t: byte_fallback.of(t.encode())))

    @SETTINGS
    @given(st.lists(piece, max_size=30).map(lambda ps: [i for p in ps for i in p]),
           st.lists(st.integers(1, 5), max_size=4), st.booleans())
    def check(ids: list[int], sizes: list[int], skip: bool) -> None:
        assert "".join(streamed(tok, chunked(ids, sizes), skip=skip)) == tok.decode(ids, skip)

    check()


def test_byte_fallback_run_that_goes_ill_formed_keeps_what_was_sent(byte_fallback: ByteFallback) -> None:
    """The one place the deltas differ from decode (module doc): byte fallback renders the whole run
    ``E6 97 A5 FF`` as four U+FFFD, but 日 was complete, and sent, before 0xFF came."""
    tok = byte_fallback.tok
    b = tok.encode("b", add_special_tokens=False)[-1]
    ids = [*byte_fallback.of(b"\xe6\x97\xa5\xff"), b]
    assert tok.decode(ids) == "\ufffd" * 4 + "b"
    assert streamed(tok, [[i] for i in ids]) == ["", "", "日", "", "\ufffdb", ""]
    # runs of bytes that never form a character are exact: one U+FFFD per byte, as decode renders them
    bad = byte_fallback.of(b"\x80\x80\xe6\xff\x80")
    ids = [b, *bad, b, *bad]
    assert "".join(streamed(tok, [[i] for i in ids])) == tok.decode(ids) == "b" + "\ufffd" * 5 + "b" + "\ufffd" * 5


def forced(n: int, token_id: int) -> Iterator[list[int]]:
    return ([token_id] for _ in range(n))


def test_2000_forced_continuation_bytes_stream_with_linear_work(tiny_model_dir: Path) -> None:
    """Byte-level: one byte lookup per id, no decode at all, and each byte out as U+FFFD at once."""
    tok = load_tokenizer(tiny_model_dir)
    work = Work(tok)
    deltas = streamed(tok, list(forced(2000, CONTINUATION)))
    assert deltas == ["\ufffd"] * 2000 + [""]
    assert work.byte_lookups == 2000 and sum(work.decode_calls) == 0
    # a character that completes after the forced bytes still comes out whole
    decoder = stream_decoder(tok)
    assert [decoder.push([i]) for i in [CONTINUATION, 0xE6, 0x97, 0xA5, CONTINUATION]] == [
        "\ufffd", "", "", "日", "\ufffd"]


def test_2000_forced_byte_fallback_bytes_stream_with_linear_work(byte_fallback: ByteFallback) -> None:
    """Window decoder: every decode call sees a bounded window, the total is linear in the ids, and
    no delta waits for more than ``MAX_HELD_IDS + 1`` bytes."""
    tok = byte_fallback.tok
    work = Work(tok)
    deltas = streamed(tok, list(forced(2000, byte_fallback.byte_ids[CONTINUATION])))
    assert "".join(deltas) == "\ufffd" * 2000
    assert max(len(d) for d in deltas) == MAX_HELD_IDS + 1 and sum(1 for d in deltas if d) == 500
    assert max(work.decode_calls) <= 2 * (MAX_HELD_IDS + 1)
    assert sum(work.decode_calls) <= 30 * 2000


def test_stop_string_of_replacement_characters_cuts_forced_bytes(tiny: Tokenizer) -> None:
    """Stop strings see the forced bytes' U+FFFD as they come, across pushes."""
    sample = SampleText(tiny, ("x\ufffd\ufffd",))
    pieces = [sample.push([i]) for i in [ord("a"), ord("x"), CONTINUATION, CONTINUATION, CONTINUATION]]
    assert pieces == ["a", "", "", "", ""] and sample.stopped
    sample = SampleText(tiny, ("日本",))
    pieces = [sample.push([i]) for i in "a日b日本c".encode()]
    assert "".join(pieces) == "a日b" and sample.stopped
