"""`SamplingParams`: how a request picks tokens and when it stops. No torch: the router builds these."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.model.structured import StructuredOutput, StructuredOutputsParams

MAX_LOGPROBS = 20  # top alternatives per token (as OpenAI's top_logprobs and vLLM's default)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids entries (a whole vocabulary of today's models)
MAX_BAD_WORDS = 64  # token sequences in bad_words_token_ids (each word counts up to twice: with a leading space)
MAX_BAD_WORD_TOKENS = 64  # tokens in one of them


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks tokens and when it stops.

    ``temperature == 0`` is greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those
    filters. ``seed`` makes sampling reproducible per request (independent of the batch it runs in).

    Before sampling (greedy too), in this order (as vLLM applies them): until ``min_tokens`` outputs
    exist, the stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) cannot be picked;
    ``logit_bias`` (token id, bias) pairs are added to the logits; ``repetition_penalty`` divides the
    positive logits and multiplies the negative ones of every token in the prompt or the output (HF,
    vLLM); ``frequency_penalty`` times its count in the output and ``presence_penalty`` once if it
    occurs there are subtracted (OpenAI). Then temperature, ``min_p`` (drop tokens below ``min_p`` times
    the top token's probability), top-k, top-p.

    ``structured_outputs``: the output must match it (`model.structured`); tokens that would leave it are
    masked out before everything above (`engine.grammar`), and the request stops (``stop``) once the
    grammar has ended, ``ignore_eos`` notwithstanding.

    ``allowed_token_ids`` (vLLM's): when set, every other token is masked out (-inf) before everything
    above but the grammar. ``bad_words_token_ids`` (vLLM's ``bad_words``, tokenized by the router): a
    one-token word is never picked; for a longer one, its last token is masked out whenever the output
    ends with the word's other tokens.

    This class is the engine's: its defaults are greedy (``temperature=0``), what internal callers and
    tests mean when they leave temperature out. The public ``kvrelay.SamplingParams`` takes vLLM's
    defaults (``temperature=1.0``).

    Raises:
        ValueError: naming the parameter and the allowed range.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias), ids distinct
    logprobs: int | None = None  # return each token's logprob and this many top alternatives (None: none)
    # vLLM's: the prompt's logprobs (`PromptTokenLogprobs`) with this many top alternatives per position; -1: the
    # whole vocabulary (refused by the engine where the vocabulary has over MAX_LOGPROBS tokens); None: none
    prompt_logprobs: int | None = None
    # constrained decoding (None: free text); a StructuredOutputsParams (vLLM's spelling) becomes a StructuredOutput
    structured_outputs: StructuredOutput | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be picked (None: any)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)  # token sequences never completed

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n <= 0:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and -1 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or -1 (the whole "
                             f"vocabulary), got {self.prompt_logprobs!r}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or not all(-100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias must map distinct token ids to biases in [-100, 100]")
        if self.allowed_token_ids is not None and not (
                self.allowed_token_ids and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if not all(w and all(isinstance(t, int) and t >= 0 for t in w) for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty token id sequences")
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            object.__setattr__(self, "structured_outputs", self.structured_outputs.to_structured())
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutput):
            raise ValueError("structured_outputs must be a StructuredOutput or StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before sampling (then the sampler needs the history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words_token_ids)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probability of a picked token and the ``top`` most likely tokens, best first, from the
    distribution it was drawn from (`model.sampling.sampling_scores`: after penalties and temperature,
    filters applied; greedy: of the adjusted logits)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class PromptTokenLogprobs:
    """One prompt position's entry of vLLM's ``prompt_logprobs``: the log-probability of the prompt's token there
    given the tokens before it, its ``rank`` (vLLM's: how many vocabulary tokens have a logprob at least as high,
    so the most likely token is 1), and the ``top`` most likely tokens, best first. Raw: the log-softmax of the
    model's logits, before any penalty, bias, mask or temperature (vLLM's default ``raw_logprobs``)."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]
