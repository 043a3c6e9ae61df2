"""vLLM's request fields beyond OpenAI's: which this server honours, and the rest, refused with a 400 naming them.

Every field of vLLM's ``ChatCompletionRequest`` and ``CompletionRequest`` is one of:

* honoured (`router.openai_api` and this module read it): sampling fields, ``bad_words``, ``allowed_token_ids``,
  ``truncate_prompt_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``, ``cache_salt``,
  ``add_special_tokens``, the chat template's inputs (``chat_template_kwargs``, ``add_generation_prompt``,
  ``continue_final_message``, ``documents``, ``reasoning_effort``), ``user`` (OpenAI's end-user id: it asks
  nothing of the answer), ``prompt_logprobs`` (`prompt_logprobs`);
* accepted only at the value that means "not used" (`NEUTRAL_ONLY`), and refused with a 400 naming the field at
  any other value, until the feature is built.

Nothing vLLM takes is ignored. Fields neither server knows are ignored, as OpenAI's API does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay.model.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGPROBS
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.router.cache_salt import MAX_CACHE_SALT_CHARS
from kvrelay.transfer.wire import MAX_PROMPT_LOGPROB_VALUES, prompt_logprob_values


class FieldError(ValueError):
    """A field refused: ``param`` names it; the message says why and what to send instead."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Refusal:
    """A field accepted only at ``neutral`` values (compared with their type: ``0`` is not ``False``); ``why``
    finishes the 400's message."""

    neutral: tuple[Any, ...]
    why: str


# Both endpoints. (functions, function_call, suffix, best_of: `router.openai_api.UNSUPPORTED_FIELD_TO_NEUTRAL`.)
NEUTRAL_ONLY: dict[str, Refusal] = {
    "use_beam_search": Refusal((False,), "beam search is not implemented; sample n choices instead"),
    "length_penalty": Refusal((1, 1.0), "it applies to beam search, which is not implemented"),
    "priority": Refusal((0,), "the router's queue serves tenants round robin and has no priorities"),
    "spaces_between_special_tokens": Refusal((True,), "the detokenizer always joins special tokens as "
                                                      "tokenizer.json decodes them"),
    "structural_tag": Refusal((), "structural tags are not implemented; use structured_outputs or tools"),
    "request_id": Refusal((), "the server names each request itself (the answer's id)"),
    "logits_processors": Refusal(([],), "custom logits processors are not loaded by this server"),
    "return_token_ids": Refusal((False,), "answers carry text (and logprobs with return_tokens_as_token_ids), "
                                          "not token id lists"),
    "kv_transfer_params": Refusal(({},), "kvrelay moves KV between its own nodes; there is no external "
                                         "connector to pass parameters to"),
    "vllm_xargs": Refusal(({},), "no extension reads them"),
    "mm_processor_kwargs": Refusal(({},), "this server takes text only"),
    "max_repetition_pattern_size": Refusal((0,), "repetition-pattern stops are not implemented"),
    "min_repetition_pattern_size": Refusal((0,), "repetition-pattern stops are not implemented"),
    "repetition_min_count": Refusal((0,), "repetition-pattern stops are not implemented"),
}
CHAT_NEUTRAL_ONLY: dict[str, Refusal] = {
    "parallel_tool_calls": Refusal((True,), "the tool-call parsers return every call the model writes"),
    "echo": Refusal((False,), "chat answers do not repeat the last message; use /v1/completions with echo"),
    "chat_template": Refusal((), "the server's chat template (the model's, or router.chat_template: --chat-template) "
                                 "renders every chat"),
}
COMPLETION_NEUTRAL_ONLY: dict[str, Refusal] = {
    "prompt_embeds": Refusal((), "prompts are text or token ids"),
}
# Chat fields a completion has no template for: refused there rather than ignored.
CHAT_ONLY = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
             "reasoning_effort")
# Names the template receives from the server; chat_template_kwargs may not set them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                     "bos_token", "eos_token", "unk_token", "pad_token"})
MAX_TEMPLATE_KWARGS = 32


def check_refused(body: dict[str, Any], *, chat: bool) -> None:
    """Raise FieldError for the first field of ``body`` set to other than its neutral value (None and absence
    are neutral), and for chat-only fields in a completion."""
    table = {**NEUTRAL_ONLY, **(CHAT_NEUTRAL_ONLY if chat else COMPLETION_NEUTRAL_ONLY)}
    for name, refusal in table.items():
        value = body.get(name)
        if value is None or any(type(value) is type(v) and value == v for v in refusal.neutral):
            continue
        neutral = " (only " + " or ".join(_json(v) for v in refusal.neutral) + " is accepted)" if refusal.neutral \
            else ""
        raise FieldError(f"{name} is not supported by this server{neutral}: {refusal.why}", name)
    if not chat:
        for name in CHAT_ONLY:
            if body.get(name) is not None:
                raise FieldError(f"{name} applies to chat templates; send it to /v1/chat/completions", name)


def _json(value: Any) -> str:
    return {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) else repr(value)


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """How a chat is rendered: ``add_generation_prompt`` (default true), ``continue_final_message`` (the last
    message is left open for the model to continue; excludes the generation prompt), ``template_kwargs`` (the
    names ``chat_template_kwargs``, ``documents`` and ``reasoning_effort`` give the template), and
    ``add_special_tokens`` (the tokenizer's BOS on top of the template's; default false, as vLLM)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = False


def chat_template_options(body: dict[str, Any]) -> ChatTemplateOptions:
    """Read the chat template fields of ``body``. Raises FieldError naming the field."""
    kwargs = typed_field(body, "chat_template_kwargs", dict, {})
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise FieldError(f"chat_template_kwargs takes at most {MAX_TEMPLATE_KWARGS} names", "chat_template_kwargs")
    for name in kwargs:
        if name in RESERVED_TEMPLATE_NAMES:
            raise FieldError(f"chat_template_kwargs may not set {name!r}: the server passes it"
                             + ("; send it as a field of its own" if name in ("add_generation_prompt",
                                                                              "continue_final_message") else ""),
                             "chat_template_kwargs")
    kwargs = dict(kwargs)
    documents = typed_field(body, "documents", list, None)
    if documents is not None:
        if not all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
            raise FieldError("documents must be a list of objects with string values (e.g. title, text)",
                             "documents")
        kwargs["documents"] = documents
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("low", "medium", "high"):
            raise FieldError(f"reasoning_effort must be low, medium or high, got {str(effort)[:40]!r}",
                             "reasoning_effort")
        kwargs["reasoning_effort"] = effort
    add_prompt = typed_field(body, "add_generation_prompt", bool, True)
    cont = typed_field(body, "continue_final_message", bool, False)
    if cont and add_prompt:
        raise FieldError("continue_final_message continues the last message, so it needs "
                         "add_generation_prompt: false", "continue_final_message")
    return ChatTemplateOptions(add_prompt, cont, kwargs, typed_field(body, "add_special_tokens", bool, False))


def continue_final(text: str, final_content: str) -> str:
    """``text`` (a chat rendered without a generation prompt) cut right after the final message's content, as
    transformers' ``continue_final_message`` does. Raises FieldError when the template does not show it."""
    content = final_content.strip() or final_content
    end = text.rfind(content) if content else -1
    if end < 0:
        raise FieldError("continue_final_message: the chat template does not render the final message's "
                         "content as it was sent; it cannot be continued", "continue_final_message")
    return text[:end + len(content)]


def bad_words_token_ids(body: dict[str, Any], tokenizer: Tokenizer | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words``: each word's tokens as written, and with a leading space where that is another first
    token of the same length (vLLM's rule). Raises FieldError naming bad_words."""
    words = typed_field(body, "bad_words", list, [])
    if not words:
        return ()
    if tokenizer is None:
        raise FieldError("bad_words needs the model's tokenizer; this model has none (use logit_bias)", "bad_words")
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise FieldError("bad_words must be a list of non-empty strings", "bad_words")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced) if spaced[:1] != plain[:1] and len(spaced) == len(plain) else (plain,):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise FieldError(f"bad_words: {word[:40]!r} is over {MAX_BAD_WORD_TOKENS} tokens", "bad_words")
            if ids and ids not in out:
                out.append(ids)
    if len(out) > MAX_BAD_WORDS:
        raise FieldError(f"bad_words: at most {MAX_BAD_WORDS} token sequences (a word counts twice when a "
                         "leading space tokenizes it apart)", "bad_words")
    return tuple(out)


def allowed_token_ids(body: dict[str, Any], vocab_size: int) -> tuple[int, ...] | None:
    """vLLM's ``allowed_token_ids``: a non-empty list of ids in the vocabulary (duplicates dropped), or None.
    Raises FieldError naming it."""
    ids = typed_field(body, "allowed_token_ids", list, None)
    if ids is None:
        return None
    if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS:
        raise FieldError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids", "allowed_token_ids")
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise FieldError(f"allowed_token_ids: {tok!r} is not a token id in [0, {vocab_size})",
                             "allowed_token_ids")
    return tuple(dict.fromkeys(ids))


def truncate_prompt(ids: list[int], body: dict[str, Any], max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last k tokens of the prompt (-1: the last max_model_len), or
    ``ids`` as they are. Raises FieldError naming it."""
    k = typed_field(body, "truncate_prompt_tokens", int, None)
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise FieldError(f"truncate_prompt_tokens must be -1 or at least 1, got {k}", "truncate_prompt_tokens")
    return ids[-k:]


def cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's ``cache_salt``: a non-empty string (`router.cache_salt` narrows the tenant's salt with it), or None.
    Raises FieldError naming it."""
    salt = typed_field(body, "cache_salt", str, None)
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise FieldError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                         "cache_salt")
    return salt


def typed_field(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """``body[name]`` if it is a ``kind`` (a bool is no int), ``default`` when absent or null. Raises FieldError."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        names = {bool: "true or false", int: "an integer", str: "a string", list: "a list", dict: "an object"}
        raise FieldError(f"{name} must be {names[kind]}, got {type(value).__name__}", name)
    return value


def prompt_logprobs(body: dict[str, Any], *, vocab_size: int, num_prompt_tokens: int) -> int | None:
    """vLLM's ``prompt_logprobs``: the top alternatives to answer at each prompt position with the prompt's own
    token (`router.prompt_logprobs`); ``-1``: the whole vocabulary; None: the prompt's logprobs are not asked for.
    As vLLM: a stream carries none, so a stream may ask only for ``0`` (which then computes nothing), and the most
    is ``MAX_LOGPROBS`` alternatives (vLLM's default ``max_logprobs``), the whole vocabulary included. A prompt
    whose answer would hold over ``MAX_PROMPT_LOGPROB_VALUES`` logprobs is refused (the prefill node's reply must
    stay within the wire's limits).

    Raises:
        FieldError: naming ``prompt_logprobs``.
    """
    value = typed_field(body, "prompt_logprobs", int, None)
    if value is None:
        return None
    if value < -1:
        raise FieldError(f"prompt_logprobs must be a positive value or -1, got {value}", "prompt_logprobs")
    if body.get("stream") and value != 0:
        raise FieldError("prompt_logprobs are not available when stream is true; ask without stream",
                         "prompt_logprobs")
    top = vocab_size if value == -1 else value
    if top > MAX_LOGPROBS:
        asked = f"-1 (the whole vocabulary, {vocab_size} tokens)" if value == -1 else str(value)
        raise FieldError(f"prompt_logprobs {asked} is over the most this server answers, {MAX_LOGPROBS}",
                         "prompt_logprobs")
    if prompt_logprob_values(num_prompt_tokens, top) > MAX_PROMPT_LOGPROB_VALUES:
        raise FieldError(f"prompt_logprobs {value} for a prompt of {num_prompt_tokens} tokens would answer "
                         f"{prompt_logprob_values(num_prompt_tokens, top)} logprobs, over the most, "
                         f"{MAX_PROMPT_LOGPROB_VALUES}; ask for fewer alternatives or send a shorter prompt",
                         "prompt_logprobs")
    return None if body.get("stream") else value
