"""OpenAI's answer shapes: a whole answer (`full_response`), stream chunks (`stream_chunk`, `usage_chunk`), a
choice's ``logprobs`` (`logprobs_body`) and a chat choice's ``message`` with its tool calls (`chat_message`)."""

from __future__ import annotations

from typing import Any

from kvrelay.model.sampling_params import TokenLogprobs
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.router.openai_api import GenerationRequest
from kvrelay.router.tool_calls import ParsedOutput, StreamDelta


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens``: the prompt tokens a node took from its
    prefix cache (whole blocks; every prompt of the request summed)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprobs_body(req: GenerationRequest, tokenizer: Tokenizer | None, token_ids: list[int],
                  logprobs: list[TokenLogprobs] | None, text_offset: int = 0) -> dict[str, Any] | None:
    """The ``logprobs`` of a choice (or of a stream chunk) for ``token_ids``, in OpenAI's shape: chat
    ``{"content": [{token, logprob, bytes, top_logprobs}]}``, completions ``{tokens, token_logprobs,
    top_logprobs, text_offset}`` (offsets from ``text_offset``, in characters of the text). None when the
    request asked for none.

    A token is its text, or ``"token_id:<id>"`` with ``req.tokens_as_ids`` (and without a tokenizer); ``bytes``
    are always its text's. Completions' ``top_logprobs`` are keyed by token: tokens with one text (byte tokens
    that each decode to U+FFFD) share a key, which keeps the most likely one's logprob.
    """
    if req.params.logprobs is None or logprobs is None:
        return None

    def text(tok: int) -> str:
        return tokenizer.decode([tok], skip_special_tokens=False) if tokenizer is not None else f"token_id:{tok}"

    def name(tok: int) -> str:
        return f"token_id:{tok}" if req.tokens_as_ids else text(tok)

    if req.kind == "chat":
        return {"content": [{
            "token": name(tok), "logprob": lp.logprob, "bytes": list(text(tok).encode()),
            "top_logprobs": [{"token": name(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in lp.top],
        } for tok, lp in zip(token_ids, logprobs, strict=True)]}
    offsets = []
    for tok in token_ids:
        offsets.append(text_offset)
        text_offset += len(text(tok))
    tops = []
    for lp in logprobs:
        top: dict[str, float] = {}
        for t, v in lp.top:
            key = name(t)
            if key not in top or v > top[key]:
                top[key] = v
        tops.append(top)
    return {"tokens": [name(tok) for tok in token_ids], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def next_text_offset(tokenizer: Tokenizer | None, token_ids: list[int], text_offset: int) -> int:
    """Completions' ``text_offset`` after ``token_ids`` (`logprobs_body` counts each token's text)."""
    if tokenizer is None:
        return text_offset + sum(len(f"token_id:{t}") for t in token_ids)
    return text_offset + sum(len(tokenizer.decode([t], skip_special_tokens=False)) for t in token_ids)


def chat_message(text: str, parsed: ParsedOutput | None, reasoning: str | None = None) -> dict[str, Any]:
    """A chat choice's ``message``: its text, or (with tools) the content outside its calls and the calls; with a
    reasoning parser, ``reasoning_content`` (None where the model did not think)."""
    message: dict[str, Any] = {"role": "assistant", "content": text if parsed is None else parsed.content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if parsed is not None and parsed.calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.calls]
    return message


def full_response(req: GenerationRequest, model: str, texts: list[str], reasons: list[str | None],
                  completion_tokens: int, logprobs: list[dict[str, Any] | None] | None = None,
                  prompt_tokens: int | None = None, parsed: list[ParsedOutput | None] | None = None,
                  cached_tokens: int = 0, reasoning: list[str] | None = None) -> dict[str, Any]:
    """``prompt_tokens``: of every prompt answered (several prompts in one request); default ``req``'s.
    ``parsed``: each chat choice's tool calls (`chat_message`); default none. ``cached_tokens``: `usage`'s.
    ``reasoning``: each chat choice's thinking, with a reasoning parser (`router.reasoning`); default none."""
    lps = logprobs or [None] * len(texts)
    if req.kind == "chat":
        calls = parsed or [None] * len(texts)
        thoughts: list[str | None] = list(reasoning) if reasoning is not None else [None] * len(texts)
        choices = [{"index": i, "message": chat_message(t, p, th), "finish_reason": r, "logprobs": lp}
                   for i, (t, r, lp, p, th) in enumerate(zip(texts, reasons, lps, calls, thoughts))]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "finish_reason": r, "logprobs": lp}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, lps))]
        obj = "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model, "choices": choices,
            "usage": usage(len(req.prompt_token_ids) if prompt_tokens is None else prompt_tokens, completion_tokens,
                           cached_tokens)}


def stream_chunk(req: GenerationRequest, model: str, index: int, text: str | None, reason: str | None,
                 *, first: bool = False, logprobs: dict[str, Any] | None = None,
                 tools: StreamDelta | None = None, reasoning: str = "") -> dict[str, Any]:
    """One SSE chunk of choice ``index``. ``tools``: with tools, what the text became (content and call
    deltas), sent in place of ``text``. ``reasoning``: chat's thinking in this chunk (``delta.reasoning_content``),
    with a reasoning parser."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        content = text if tools is None else tools.content
        if content:
            delta["content"] = content
        if tools is not None and tools.calls:
            delta["tool_calls"] = [c.to_openai() for c in tools.calls]
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model, "choices": [choice]}


def extension_chunk(req: GenerationRequest, model: str) -> dict[str, Any]:
    """A stream chunk with no choices (as the usage chunk), for the ``kvrelay`` extension's answer."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model, "choices": []}


def usage_chunk(req: GenerationRequest, model: str, completion_tokens: int,
                prompt_tokens: int | None = None, cached_tokens: int = 0) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": model, "choices": [],
            "usage": usage(len(req.prompt_token_ids) if prompt_tokens is None else prompt_tokens, completion_tokens,
                           cached_tokens)}
