"""OpenAI-compatible request parsing (``/v1/completions``, ``/v1/chat/completions``); the answers' shapes are in
`router.openai_responses`.

Parsing turns a JSON body into a `GenerationRequest` or raises `ApiError` with the HTTP status and
a message that names the offending field. Every field vLLM takes is honoured or refused (`router.request_fields`);
fields neither server knows are ignored, as OpenAI's API does.

Defaults, as vLLM's: a chat answer without ``max_tokens`` / ``max_completion_tokens`` may fill the rest of the
context (capped by the model's ``max_new_tokens``), a completion 16 tokens (fewer where the context ends first);
the sampling fields a request leaves out take the model's generation_config.json values
(`ServedModel.defaults`, `model.generation_config`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvrelay.model.generation_config import GenerationDefaults
from kvrelay.model.sampling_params import MAX_LOGPROBS, SamplingParams
from kvrelay.model.structured import StructuredOutput
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.router import request_fields
from kvrelay.router.grammar_limits import GrammarLimits, check_grammar
from kvrelay.router.harmony import HarmonyInputError, render_chat
from kvrelay.router.request_fields import FieldError
from kvrelay.router.structured_api import StructuredError, check_compiles, structured_from_body
from kvrelay.router.tool_api import ToolError, ToolPlan, template_message, tool_plan
from kvrelay.router.tool_calls import ToolOutput
from openai_harmony import HarmonyEncoding

MAX_STOP_STRING_CHARS = 1024  # each; matched against the text at every token
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 4
# Fields this server does not implement, with the values that mean "not used" and are accepted (OpenAI's
# deprecated functions / function_call: send tools / tool_choice).
UNSUPPORTED_FIELD_TO_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""), "best_of": (None, 1),
}
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_PROMPTS = 64  # prompts in one /v1/completions request
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions and vLLM's CompletionRequest


class ApiError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status``; ``retry_after_s`` goes into
    the Retry-After header of a 429 or 503 (None: the router's default)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the router serves: the name clients use, limits, the tokenizer, and how the API behaves:
    ``tool_call_parser`` finds calls for tool_choice ``auto`` (`router.tool_calls`; None: none fits the model),
    which needs ``enable_auto_tool_choice`` (vLLM's flag); ``return_tokens_as_token_ids`` is the default of the
    request field; ``defaults`` fill the sampling fields a request leaves out; ``eos_token_ids`` are the ids the
    engine stops on (the generation config's others become stop ids)."""

    name: str
    vocab_size: int
    max_model_len: int
    max_n: int
    tokenizer: Tokenizer | None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # `router.reasoning`: chat's thinking apart from its content; None: no split
    enable_auto_tool_choice: bool = False
    return_tokens_as_token_ids: bool = False
    defaults: GenerationDefaults = GenerationDefaults()
    eos_token_ids: tuple[int, ...] = ()
    harmony: HarmonyEncoding | None = None  # gpt-oss: chat is rendered and parsed in harmony (`router.harmony`)
    grammar_limits: GrammarLimits = GrammarLimits()  # an EBNF grammar over them is a 400 (`router.grammar_limits`)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request. ``kind`` is ``completion`` or ``chat``."""

    request_id: str
    kind: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    created: int
    long_context: dict[str, Any] | None = None  # ``kvrelay.long_context``: overrides of decode.long_context
    echo_text: str | None = None  # completions' ``echo``: the prompt's text, put before each choice's text
    structured_param: str | None = None  # the field ``params.structured_outputs`` came from (400s name it)
    tool_output: ToolOutput | None = None  # chat with tools: how each choice's text becomes tool calls
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    timings: bool = False  # ``kvrelay.timings``: the answer carries the request's stage timings
    cache_salt: str | None = None  # vLLM's cache_salt: narrows the tenant's KV salt (`router.cache_salt`)
    skip_special_tokens: bool = True  # special tokens are left out of the text
    include_stop_str_in_output: bool = False  # the stop string that ended a choice stays in its text
    include_reasoning: bool = True  # chat with a reasoning parser: the thinking is answered (reasoning_content)
    # gpt-oss chat (`router.harmony_output`): whether function calls become tool_calls; None: not harmony
    harmony_calls: bool | None = None


@dataclass(frozen=True, slots=True)
class KvrelayExtension:
    """The ``kvrelay`` extension field of a request."""

    long_context: dict[str, Any] | None = None  # overrides of decode.long_context
    timings: bool = False  # answer with the stage timings (`router.request_trace`)


def _kvrelay_extension(body: dict[str, Any]) -> KvrelayExtension:
    """The ``kvrelay`` extension field: ``{"long_context": {"policy": "h2o", "device_budget_tokens": 512, ...},
    "timings": true}``.

    Only long_context's shape is checked here; `engine.long_context.LongContextConfig.with_overrides` checks its
    fields (the router before prefill, the decode node again).
    """
    ext = _get(body, "kvrelay", dict, None)
    if ext is None:
        return KvrelayExtension()
    unknown = sorted(set(ext) - {"long_context", "timings"})
    if unknown:
        raise ApiError(400, f"kvrelay: unknown field {unknown[0]!r}; the extension takes long_context and timings",
                       param="kvrelay")
    lc = ext.get("long_context")
    if lc is not None and not isinstance(lc, dict):
        raise ApiError(400, "kvrelay.long_context must be an object", param="kvrelay.long_context")
    timings = ext.get("timings", False)
    if not isinstance(timings, bool):
        raise ApiError(400, f"kvrelay.timings must be true or false, got {type(timings).__name__}",
                       param="kvrelay.timings")
    return KvrelayExtension(lc, timings)


def _get(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"{name} must be {_type_names(types)}, got a boolean", param=name)
    if not isinstance(value, types):
        raise ApiError(400, f"{name} must be {_type_names(types)}, got {type(value).__name__}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    """A finite-or-NaN float from an int or float field (an int too large for a float is a 400)."""
    value = _get(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:
        raise ApiError(400, f"{name} is out of range", param=name) from None


def _type_names(types: type | tuple[type, ...]) -> str:
    names = [t.__name__ for t in (types if isinstance(types, tuple) else (types,))]
    return " or ".join({"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
                        "list": "a list", "dict": "an object"}.get(n, n) for n in names)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top alternatives to return with each token's logprob; None: no logprobs. Completions
    take ``logprobs: N``; chat takes ``logprobs: true`` with ``top_logprobs: N``."""
    if chat:
        wanted = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int, None)
        if top is not None and not wanted:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        name = "top_logprobs"
        count = (top or 0) if wanted else None
    else:
        name = "logprobs"
        count = _get(body, "logprobs", int, None)
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {count}", param=name)
    return count


def _max_tokens(body: dict[str, Any], served: ServedModel, prompt_len: int, *, chat: bool) -> int:
    """The request's ``max_tokens`` (or ``max_completion_tokens``), else vLLM's default: the rest of the context
    (chat: capped by the model's max_new_tokens; completions: at most 16). Raises ApiError(400) for a prompt that
    leaves no room."""
    max_tokens = _get(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is not None:
        return max_tokens
    room = served.max_model_len - prompt_len
    if room <= 0:
        raise ApiError(400, f"this model's context window is {served.max_model_len} tokens and the prompt has "
                            f"{prompt_len}: no room for an answer; shorten the prompt (or send "
                            "truncate_prompt_tokens)", param="prompt" if not chat else "messages")
    cap = (served.defaults.max_tokens or room) if chat else COMPLETION_DEFAULT_MAX_TOKENS
    return min(room, cap)


def _sampling(body: dict[str, Any], served: ServedModel, prompt_len: int, *,
              chat: bool = False) -> tuple[SamplingParams, tuple[str, ...]]:
    max_tokens = _max_tokens(body, served, prompt_len, chat=chat)
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if prompt_len + max_tokens > served.max_model_len:
        raise ApiError(
            400,
            f"this model's context window is {served.max_model_len} tokens, but the request asks for "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} in the completion); "
            "shorten the prompt or lower max_tokens",
            param="max_tokens" if prompt_len < served.max_model_len else "prompt",
        )
    defaults = served.defaults
    temperature = _number(body, "temperature", defaults.temperature)
    if not 0 <= temperature <= 2:  # NaN fails too
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = _number(body, "top_p", defaults.top_p)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = _get(body, "top_k", int, defaults.top_k)
    if not -1 <= top_k <= served.vocab_size:
        raise ApiError(400, f"top_k must be -1 or 0 (disabled) or at most the vocabulary size "
                            f"({served.vocab_size}), got {top_k}", param="top_k")
    seed = _get(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"seed must be in [0, 2**63), got {seed}", param="seed")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= served.max_n:
        raise ApiError(400, f"n must be between 1 and {served.max_n} on this server, got {n}", param="n")
    stop = body.get("stop")
    stops: tuple[str, ...]
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise ApiError(400, f"a stop string is at most {MAX_STOP_STRING_CHARS} characters", param="stop")
    stop_ids = _get(body, "stop_token_ids", list, [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}",
                       param="stop_token_ids")
    _check_ids(stop_ids, served, "stop_token_ids")
    ignore_eos = _get(body, "ignore_eos", bool, False)
    for name, allowed in UNSUPPORTED_FIELD_TO_NEUTRAL.items():
        if body.get(name) not in allowed:
            raise ApiError(400, f"{name} is not supported by this server (only {allowed[-1]!r} is accepted)",
                           param=name)
    penalties = {}
    for name, low, high, neutral in (("presence_penalty", -2.0, 2.0, 0.0), ("frequency_penalty", -2.0, 2.0, 0.0),
                                     ("repetition_penalty", 0.0, 2.0, defaults.repetition_penalty),
                                     ("min_p", 0.0, 1.0, defaults.min_p)):
        value = _number(body, name, neutral)
        lower_ok = value > low if name == "repetition_penalty" else value >= low
        if not (lower_ok and value <= high):  # NaN fails too
            bounds = f"({low:g}, {high:g}]" if name == "repetition_penalty" else f"[{low:g}, {high:g}]"
            raise ApiError(400, f"{name} must be in {bounds}, got {value}", param=name)
        penalties[name] = value
    min_tokens = _get(body, "min_tokens", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise ApiError(400, f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}",
                       param="min_tokens")
    if not ignore_eos:  # as vLLM: the generation config's other EOS ids end a choice too
        stop_ids = list(dict.fromkeys([*stop_ids, *(t for t in defaults.eos_token_ids
                                                    if t not in served.eos_token_ids and t < served.vocab_size)]))
    try:
        bad_words = request_fields.bad_words_token_ids(body, served.tokenizer)
        allowed = request_fields.allowed_token_ids(body, served.vocab_size)
        prompt_logprobs = request_fields.prompt_logprobs(body, vocab_size=served.vocab_size,
                                                         num_prompt_tokens=prompt_len)
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed, n=n,
        stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos, min_tokens=min_tokens,
        logit_bias=_logit_bias(body, served), logprobs=_logprobs(body, chat), prompt_logprobs=prompt_logprobs,
        structured_outputs=_structured(body, served), allowed_token_ids=allowed, bad_words_token_ids=bad_words,
        **penalties,
    )
    return params, stops


def _output_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The `GenerationRequest` fields vLLM's output options set: cache_salt, skip_special_tokens,
    include_stop_str_in_output, include_reasoning. Raises ApiError(400) naming the field."""
    typed = request_fields.typed_field
    try:
        return {"cache_salt": request_fields.cache_salt(body),
                "skip_special_tokens": typed(body, "skip_special_tokens", bool, True),
                "include_stop_str_in_output": typed(body, "include_stop_str_in_output", bool, False),
                "include_reasoning": typed(body, "include_reasoning", bool, True)}
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _check_refused(body: dict[str, Any], *, chat: bool) -> None:
    try:
        request_fields.check_refused(body, chat=chat)
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _structured(body: dict[str, Any], served: ServedModel) -> StructuredOutput | None:
    """The constraint the body asks for (`router.structured_api`), checked to compile. Raises ApiError(400)
    naming the field."""
    try:
        out, param = structured_from_body(body)
        if out is not None:
            assert param is not None
            if served.tokenizer is None:
                raise StructuredError("structured outputs need the model's tokenizer; this model has none", param)
            if out.kind == "grammar":
                check_grammar(out.spec, param, served.grammar_limits)
            check_compiles(out, param)
    except StructuredError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    return out


def _structured_param(body: dict[str, Any]) -> str | None:
    """The field of an already parsed body (`_structured`) that constrains its output, or None."""
    return structured_from_body(body)[1]


def _logit_bias(body: dict[str, Any], served: ServedModel) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"token id": bias in [-100, 100]}`` (keys are strings in JSON)."""
    raw = _get(body, "logit_bias", dict, {})
    if len(raw) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(raw)}", param="logit_bias")
    pairs = []
    for key, bias in raw.items():
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias: {str(key)[:40]!r} is not a token id", param="logit_bias") from None
        if not 0 <= tok < served.vocab_size:
            raise ApiError(400, f"logit_bias: token id {tok} is outside the vocabulary [0, {served.vocab_size})",
                           param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias[{key!r}] must be a number in [-100, 100], got {bias!r}",
                           param="logit_bias")
        pairs.append((tok, float(bias)))
    if len({t for t, _ in pairs}) != len(pairs):
        raise ApiError(400, "logit_bias names a token id twice", param="logit_bias")
    return tuple(pairs)


def _check_model(body: dict[str, Any], served: ServedModel) -> None:
    model = body.get("model")
    if model is None:
        raise ApiError(400, "model is required", param="model")
    if model != served.name:
        raise ApiError(404, f"model {model!r} not found; this server serves {served.name!r}", param="model",
                       kind="not_found_error")


def _check_ids(ids: list[Any], served: ServedModel, param: str) -> list[int]:
    for pos, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < served.vocab_size:
            raise ApiError(400, f"token id {tok!r} at position {pos} is outside the vocabulary "
                                f"[0, {served.vocab_size})", param=param)
    return list(ids)


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, {})
    include_usage = bool(opts.get("include_usage", False))
    if opts.get("continuous_usage_stats"):
        raise ApiError(400, "stream_options.continuous_usage_stats is not supported by this server: usage comes "
                            "once, on the last chunk (include_usage)", param="stream_options")
    return stream, include_usage


def parse_completions(body: Any, served: ServedModel) -> list[GenerationRequest]:
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them, each its own request
    (its choices come after the previous prompt's: ``index = prompt number · n + sample``)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, served)
    _check_refused(body, chat=False)
    prompt = body.get("prompt")
    if prompt == []:
        raise ApiError(400, "prompt is empty", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list))):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of several of either",
                       param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt takes at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
                       param="prompt")
    echo = _get(body, "echo", bool, False)
    add_special = _get(body, "add_special_tokens", bool, True)
    stream, include_usage = _stream_options(body)
    created, extension, output = int(time.time()), _kvrelay_extension(body), _output_fields(body)
    out = []
    for k, one in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
        if isinstance(one, str):
            if served.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
            ids = served.tokenizer.encode(one, add_special_tokens=add_special)
        elif isinstance(one, list):
            ids = _check_ids(one, served, where)
        else:
            raise ApiError(400, f"{where} must be a string or a list of token ids", param="prompt")
        if not ids:
            raise ApiError(400, f"{where} is empty", param="prompt")
        ids = _truncated(ids, body, served)
        params, stops = _sampling(body, served, len(ids))
        if echo and params.logprobs is not None:
            raise ApiError(400, "echo with logprobs (the prompt's logprobs in the choice's logprobs) is not built; "
                                "ask for them with prompt_logprobs instead", param="echo")
        echo_text = None
        if echo:
            echo_text = one if isinstance(one, str) else (
                served.tokenizer.decode(ids) if served.tokenizer is not None else "")
        out.append(GenerationRequest(f"cmpl-{uuid.uuid4().hex}", "completion", ids, params, stops, stream,
                                     include_usage, created, extension.long_context, echo_text,
                                     _structured_param(body), tokens_as_ids=_tokens_as_ids(body, served),
                                     timings=extension.timings, **output))
    return out


def _truncated(ids: list[int], body: dict[str, Any], served: ServedModel) -> list[int]:
    try:
        return request_fields.truncate_prompt(ids, body, served.max_model_len)
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def parse_completion(body: Any, served: ServedModel) -> GenerationRequest:
    """`parse_completions` for a body with one prompt. Raises ApiError for several."""
    reqs = parse_completions(body, served)
    if len(reqs) != 1:
        raise ApiError(400, f"expected one prompt, got {len(reqs)}", param="prompt")
    return reqs[0]


def parse_tokenize(body: Any, served: ServedModel) -> list[int]:
    """``POST /tokenize``: ``{"model", "prompt": text}`` or ``{"model", "messages": [...]}`` (rendered with
    the chat template, as /v1/chat/completions would) → token ids."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, served)
    if "messages" in body and served.harmony is not None:  # as chat renders it, its tools in (tool_choice auto)
        try:
            return render_chat(served.harmony, {"messages": body["messages"], "tools": body.get("tools")},
                               auto_tools=True).token_ids
        except HarmonyInputError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
    tok = served.tokenizer
    if tok is None:
        raise ApiError(400, "this model has no tokenizer", param="prompt")
    if "messages" in body:
        chat = {"model": body["model"], "messages": body["messages"], "max_tokens": 1, "tools": body.get("tools"),
                "tool_choice": "none"}
        return parse_chat(chat, served, check_length=False).prompt_token_ids
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string (or send messages)", param="prompt")
    return tok.encode(prompt, add_special_tokens=_get(body, "add_special_tokens", bool, True))


def parse_detokenize(body: Any, served: ServedModel) -> str:
    """``POST /detokenize``: ``{"model", "tokens": [ids]}`` → text."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, served)
    if served.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", param="tokens")
    ids = _get(body, "tokens", list, None)
    if ids is None:
        raise ApiError(400, "tokens is required (a list of token ids)", param="tokens")
    return served.tokenizer.decode(_check_ids(ids, served, "tokens"))


def parse_chat(body: Any, served: ServedModel, *, check_length: bool = True) -> GenerationRequest:
    """``POST /v1/chat/completions``: messages rendered with the model's chat template, with the ``tools``
    (`router.tool_api`). ``check_length=False``: only render and tokenize (``/tokenize``), whatever the
    context window."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body, served)
    _check_refused(body, chat=True)
    if served.harmony is not None:
        return _harmony_chat(body, served, served.harmony, check_length=check_length)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    tok = served.tokenizer
    try:
        clean = [_message(i, msg) for i, msg in enumerate(messages)]
        plan = tool_plan(body, parser=served.tool_call_parser, auto_enabled=served.enable_auto_tool_choice,
                         tokenizer=tok)
        options = request_fields.chat_template_options(body)
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    if tok is None or tok.chat_template is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tok.apply_chat_template(clean, add_generation_prompt=options.add_generation_prompt, tools=plan.tools,
                                       template_kwargs=options.template_kwargs)
    except Exception as exc:  # noqa: BLE001 - template errors are the client's messages' fault
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    if options.continue_final_message:
        try:
            text = request_fields.continue_final(text, clean[-1].get("content") or "")
        except FieldError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
    ids = _truncated(tok.encode(text, add_special_tokens=options.add_special_tokens), body, served)
    params, stops = _sampling(body, served, len(ids) if check_length else 0, chat=True)
    structured_param = _structured_param(body)
    params, structured_param = _tool_constraint(plan, params, structured_param)
    stream, include_usage = _stream_options(body)
    extension = _kvrelay_extension(body)
    return GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", "chat", ids, params, stops, stream, include_usage,
                             int(time.time()), extension.long_context, structured_param=structured_param,
                             tool_output=plan.output, tokens_as_ids=_tokens_as_ids(body, served),
                             timings=extension.timings, **_output_fields(body))


def _harmony_chat(body: dict[str, Any], served: ServedModel, encoding: HarmonyEncoding, *,
                  check_length: bool) -> GenerationRequest:
    """`parse_chat` for gpt-oss: the prompt rendered in harmony (`router.harmony`), harmony's stop tokens for the
    assistant's actions (``<|return|>``, ``<|call|>``) added. Stop strings and structured outputs are refused: the
    output is parsed from token ids, and a constraint would bind its channels too."""
    try:
        prompt = render_chat(encoding, body, auto_tools=served.enable_auto_tool_choice)
    except HarmonyInputError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    ids = _truncated(prompt.token_ids, body, served)
    params, stops = _sampling(body, served, len(ids) if check_length else 0, chat=True)
    if stops:
        raise ApiError(400, "stop strings do not apply to gpt-oss chat: its output is parsed from token ids; send "
                            "stop_token_ids", param="stop")
    structured_param = _structured_param(body)
    if params.structured_outputs is not None:
        raise ApiError(400, f"{structured_param} does not apply to gpt-oss chat: a constraint would bind the harmony "
                            "output's channels too", param=structured_param)
    # harmony returns a set, in any order: sorted, so every run sends the same tuple
    stop_ids = tuple(dict.fromkeys([*params.stop_token_ids, *sorted(encoding.stop_tokens_for_assistant_actions())]))
    params = dataclasses.replace(params, stop_token_ids=stop_ids)
    stream, include_usage = _stream_options(body)
    extension = _kvrelay_extension(body)
    return GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", "chat", ids, params, stops, stream, include_usage,
                             int(time.time()), extension.long_context, tokens_as_ids=_tokens_as_ids(body, served),
                             timings=extension.timings, harmony_calls=prompt.calls, **_output_fields(body))


def _message(i: int, msg: Any) -> dict[str, Any]:
    """Message ``i`` for the chat template. Raises ApiError (text content only) or ToolError."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a string role", param="messages")
    content = msg.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: {str(kind)[:40]!r} parts are not supported; this "
                                    "server takes text parts only", param="messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str) and not (content is None and msg["role"] == "assistant"):
        raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
    return template_message(i, msg, content)


def _tool_constraint(plan: ToolPlan, params: SamplingParams,
                     structured_param: str | None) -> tuple[SamplingParams, str | None]:
    """``params`` with the schema tool_choice ``required`` or a named function forces, and the field it came
    from. Raises ApiError(400) naming tool_choice for a request constrained by another field too, or a schema
    that is not one."""
    if plan.constraint is None:
        return params, structured_param
    if params.structured_outputs is not None:
        raise ApiError(400, f"tool_choice constrains the output to tool calls, and {structured_param} constrains "
                            "it too; send one of them", param="tool_choice")
    try:
        check_compiles(plan.constraint, "tool_choice")
    except StructuredError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    return dataclasses.replace(params, structured_outputs=plan.constraint), "tool_choice"


def _tokens_as_ids(body: dict[str, Any], served: ServedModel) -> bool:
    return _get(body, "return_tokens_as_token_ids", bool, served.return_tokens_as_token_ids)
