"""Constrained decoding with xgrammar: a `StructuredOutput` compiled against the model's vocabulary into a grammar
whose matcher masks, before each sample, every token that would leave it.

* `grammar_of`: the grammar of a constraint, without a vocabulary.
* `Grammars`: one per engine. Builds the vocabulary's `xgrammar.TokenizerInfo` from the model's ``tokenizer.json``
  on first use and compiles each constraint once (LRU by `StructuredOutput.cache_key`, bounded in count and in
  bytes; with a ``compile_timeout_s``, a new constraint is compiled first in a child process that is killed at
  the deadline: `engine.grammar_check`); `compile` is
  thread-safe and meant to run off the engine thread: a node compiles in ``read_request`` and carries the result to
  the engine in `StructuredOutput.compiled`, so its engine thread never compiles; the offline `kvrelay.LLM`
  compiles on its engine thread at ``add_request``.
* `Matcher`: one per sample. Built from the compiled grammar and the sample's output tokens so far (a decode node
  replays the first token the prefill node sampled, or every token of a request that moved; no matcher state ever
  crosses the wire). Holds no torch state; `apply_masks` masks a batch of logits rows in place.

JSON has no free whitespace (xgrammar's ``any_whitespace=False``: exactly ``", "`` and ``": "`` between items):
a small model offered free whitespace can spend its whole budget on it. Object properties the schema does not
name are not generated (xgrammar's strict mode, as vLLM compiles every schema).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.engine.grammar_check import CompileCheck, CompileRefused
from kvrelay.model.structured import GRAMMAR_ERROR_PREFIX, StructuredOutput

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr
    from kvrelay.model.sampling_params import SamplingParams

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")
MAX_COMPILED = 128  # compiled grammars kept per engine (a JSON schema's is ~100 KB–MBs with a 50k vocabulary)
# ... and their bytes (xgrammar's memory_size_bytes): a 3,000-rule chain weighs 4.5 MB, 128 of them 580 MB
MAX_COMPILED_BYTES = 256 * 1024 * 1024


class GrammarError(ValueError):
    """A constraint that does not compile (xgrammar's reason), or a model without a vocabulary to compile for."""


def grammar_of(out: StructuredOutput) -> xgr.Grammar:
    """The xgrammar grammar of ``out`` (no vocabulary).

    Raises:
        Exception: xgrammar's, for a schema, regex or EBNF it cannot convert.
    """
    import xgrammar as xgr

    if out.kind == "json":
        return xgr.Grammar.from_json_schema(out.spec, any_whitespace=False, strict_mode=True)
    if out.kind == "json_object":
        return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False)
    if out.kind == "regex":
        return xgr.Grammar.from_regex(out.spec)
    if out.kind == "choice":
        # Non-ASCII as itself: ASCII-escaped, a character beyond the BMP becomes two surrogate escapes, which
        # xgrammar reads as two code points no token spells (an emoji choice could never be generated).
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in out.choices))
    return xgr.Grammar.from_ebnf(out.spec)


class Grammars:
    """Compiles constraints for one model's vocabulary.

    Args:
        model_dir: holds ``tokenizer.json`` (the vocabulary); None: the model has none and every `compile` raises.
        vocab_size: rows of the model's logits (may exceed the tokenizer's ids: padded embeddings).
        stop_token_ids: the tokens that end a finished grammar (the model's EOS ids).
        compile_timeout_s: the deadline of a new constraint's compile (`engine.grammar_check`); None: none, the
            compile runs in the calling thread only.
        max_compiled: compiled grammars kept (0: none).
    """

    def __init__(self, model_dir: str | Path | None, vocab_size: int, stop_token_ids: Sequence[int], *,
                 compile_timeout_s: float | None = None, max_compiled: int = MAX_COMPILED) -> None:
        self.model_dir = None if model_dir is None else Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_compiled = max_compiled
        self._lock = threading.Lock()  # guards _compiled and _compiled_bytes (held for a dict operation only)
        self._build_lock = threading.Lock()  # guards _compiler and compiling
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[tuple[Any, ...], tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._compiled_bytes = 0
        self.compiles = 0  # grammars compiled (cache misses)
        self.check = None if compile_timeout_s is None or self.model_dir is None else CompileCheck(
            serve_checks, self.model_dir, vocab_size, self.stop_token_ids, timeout_s=compile_timeout_s)

    def compiler(self) -> xgr.GrammarCompiler:
        """xgrammar's compiler for this vocabulary (built on first use: seconds).

        Raises:
            GrammarError: the model has no vocabulary.
        """
        import xgrammar as xgr

        if self._compiler is None:
            path = None if self.model_dir is None else self.model_dir / "tokenizer.json"
            if path is None or not path.is_file():
                raise GrammarError(f"{GRAMMAR_ERROR_PREFIX}the model has no tokenizer.json (the vocabulary a "
                                   "constraint is compiled for)")
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, out: StructuredOutput) -> xgr.CompiledGrammar:
        """``out`` compiled for this vocabulary, from the cache when it was compiled before. Thread-safe;
        blocking (milliseconds to a second for a large schema).

        Raises:
            GrammarError: xgrammar refuses it, with its reason; or the model has no vocabulary.
        """
        key = out.cache_key
        hit = self._cached(key)
        if hit is not None:
            return hit
        if self.check is not None:  # bounded in time, killable; refusals remembered
            try:
                self.check.check(out)
            except CompileRefused as exc:
                raise GrammarError(str(exc)) from None
        with self._build_lock:  # one compile at a time; a cache hit (above) never waits for one
            hit = self._cached(key)
            if hit is not None:
                return hit
            compiler = self.compiler()
            try:
                compiled = compiler.compile_grammar(grammar_of(out))
            except Exception as exc:  # noqa: BLE001 - xgrammar's error kinds vary by version
                raise GrammarError(f"{GRAMMAR_ERROR_PREFIX}the {out.kind} constraint does not compile: "
                                   f"{_first_line(exc)}") from None
            self._keep(key, compiled)
            return compiled

    def _keep(self, key: tuple[Any, ...], compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            self.compiles += 1
            self._compiled[key] = (compiled, size)
            self._compiled_bytes += size
            while self._compiled and (len(self._compiled) > self.max_compiled
                                      or self._compiled_bytes > MAX_COMPILED_BYTES):
                self._compiled_bytes -= self._compiled.popitem(last=False)[1][1]

    @property
    def compiled_bytes(self) -> int:
        """The bytes of the compiled grammars kept (xgrammar's ``memory_size_bytes``), at most MAX_COMPILED_BYTES."""
        with self._lock:
            return self._compiled_bytes

    def _cached(self, key: tuple[Any, ...]) -> xgr.CompiledGrammar | None:
        with self._lock:
            hit = self._compiled.get(key)
            if hit is None:
                return None
            self._compiled.move_to_end(key)
            return hit[0]

    def matcher(self, out: StructuredOutput, tokens: Sequence[int]) -> Matcher:
        """A matcher for ``out`` that has accepted ``tokens`` (a sample's outputs so far).

        Raises:
            GrammarError: the constraint does not compile, or ``tokens`` leave the grammar (naming the first
                that does).
        """
        return Matcher(out.compiled if out.compiled is not None else self.compile(out), tokens)


def serve_checks(conn: Connection, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
    """The child of a `CompileCheck`: compile each constraint received; answer None, or the refusal's text."""
    grammars = Grammars(model_dir, vocab_size, stop_token_ids, max_compiled=0)
    grammars.compiler()  # the vocabulary, before the first deadline starts
    conn.send("ready")
    while True:
        try:
            out = conn.recv()
        except EOFError:
            return
        try:
            grammars.compile(out)
            conn.send(None)
        except GrammarError as exc:
            conn.send(str(exc))


class Matcher:
    """The grammar state of one sample (xgrammar's ``GrammarMatcher``)."""

    __slots__ = ("_m",)

    def __init__(self, compiled: xgr.CompiledGrammar, tokens: Sequence[int] = ()) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        for pos, tok in enumerate(tokens):
            if not self._m.accept_token(int(tok)):
                raise GrammarError(f"{GRAMMAR_ERROR_PREFIX}output token {tok} at position {pos} does not match "
                                   "the constraint")

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (state unchanged) when the grammar does not allow it."""
        return bool(self._m.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): the sample stops."""
        return bool(self._m.is_terminated())

    def fork(self) -> Matcher:
        """An independent copy at the same state (``n > 1`` samples splitting off one prefill)."""
        twin = Matcher.__new__(Matcher)
        twin._m = self._m.fork()
        return twin

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


def apply_masks(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
    """Set to -inf, in place, every token of ``logits`` ``[N, vocab]`` (float32) the row's matcher does not allow
    next; rows whose matcher is None are left alone."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)
    for i in rows:
        matchers[i].fill(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows)


def lift_min_tokens(params: SamplingParams, row: torch.Tensor, num_output_tokens: int,
                    eos_token_ids: Collection[int]) -> SamplingParams:
    """The params to sample a constrained sample's masked logits ``row`` ``[vocab]`` with: ``params``, or
    ``params`` without ``min_tokens`` when its grammar allows only the stop tokens ``min_tokens`` holds back.

    The grammar has ended there: holding its stop token back would leave every logit at -inf (greedy would pick
    token 0, outside the grammar; a sampled row cannot be drawn from at all). The grammar wins; the sample stops.
    """
    import torch

    if num_output_tokens >= params.min_tokens:
        return params
    held_back = [t for t in (*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids))
                 if 0 <= t < row.shape[-1]]
    allowed = torch.isfinite(row)
    allowed[held_back] = False
    return params if bool(allowed.any()) else dataclasses.replace(params, min_tokens=0)


def _first_line(exc: BaseException) -> str:
    """xgrammar's reason, without the log prefix of its C++ source (``[08:00:02] /project/cpp/x.cc:94: ``)."""
    text = str(exc).strip()
    line = _XGRAMMAR_LOG_PREFIX.sub("", text.splitlines()[0]) if text else ""
    return line[:300] or type(exc).__name__
