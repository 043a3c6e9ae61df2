"""The internal wire format between router, prefill and decode: msgpack maps with size limits.

Nothing is pickled. Every decoder sets msgpack's length limits and checks field types, raising
`ProtocolError` with the field named, so a malformed body is a 400, never a crash.

    prefill request   {"request_id", "prompt", "params", "salt"}
    prefill response  {"first_token_ids", "finish_reasons", "handle", "num_cached_tokens"}
    decode request    {"request_id", "prompt", "params", "salt", "first_token_ids"?, "handle"?, "long_context"?}
    decode stream     frames {"index", "tokens", "finished", "reason"} | {"error", "status"}

Internal endpoints take the deployment's shared secret in `transfer.config.TOKEN_HEADER`. No torch
here: the router imports this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from model.sampling_params import SamplingParams

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_PROMPT_TOKENS = 4 * 1024 * 1024
_LIMITS: dict[str, int] = dict(max_bin_len=16 * 1024 * 1024, max_str_len=1024 * 1024,
                               max_array_len=MAX_PROMPT_TOKENS, max_map_len=64, max_ext_len=0)


class ProtocolError(ValueError):
    """A malformed internal message; the text names the field."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode one msgpack object with the size limits above. Raises ProtocolError."""
    if len(data) > MAX_BODY_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, **_LIMITS)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"malformed msgpack: {exc}") from None


def new_unpacker() -> msgpack.Unpacker:
    """A streaming unpacker with the same limits (for decode's framed token stream)."""
    return msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_BODY_BYTES, **_LIMITS)


def field(msg: Any, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """``msg[name]`` checked to be ``kind``. Raises ProtocolError naming the field."""
    if not isinstance(msg, dict):
        raise ProtocolError("message must be a map")
    if name not in msg or msg[name] is None:
        if optional:
            return None
        raise ProtocolError(f"field {name!r} is missing")
    value = msg[name]
    if isinstance(value, bool) and kind is int or not isinstance(value, kind):
        raise ProtocolError(f"field {name!r} has type {type(value).__name__}")
    return value


def int_list(msg: Any, name: str, *, optional: bool = False) -> list[int] | None:
    value = field(msg, name, list, optional=optional)
    if value is None:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value):
        raise ProtocolError(f"field {name!r} must be a list of token ids")
    return value


@dataclass(frozen=True, slots=True)
class GenerationMessage:
    """A prefill or decode request as it arrives on the wire (see the module docstring)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    salt: bytes
    first_token_ids: list[int] | None
    handle: dict[str, Any] | None
    long_context: dict[str, Any] | None = None  # the request's overrides of decode.long_context


def parse_generation(data: bytes) -> GenerationMessage:
    """Decode and check a prefill/decode request body. Raises ProtocolError naming the bad field."""
    msg = unpack(data)
    prompt = int_list(msg, "prompt")
    assert prompt is not None
    return GenerationMessage(
        request_id=field(msg, "request_id", str), prompt=prompt, params=params_from_wire(field(msg, "params", dict)),
        salt=field(msg, "salt", bytes), first_token_ids=int_list(msg, "first_token_ids", optional=True),
        handle=field(msg, "handle", dict, optional=True), long_context=field(msg, "long_context", dict, optional=True),
    )



def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    out["stop_token_ids"] = list(params.stop_token_ids)
    return out


_PARAM_FIELDS: dict[str, Callable[[Any], bool]] = {
    "max_tokens": lambda v: isinstance(v, int), "temperature": lambda v: isinstance(v, (int, float)),
    "top_p": lambda v: isinstance(v, (int, float)), "top_k": lambda v: isinstance(v, int),
    "seed": lambda v: v is None or isinstance(v, int), "n": lambda v: isinstance(v, int),
    "stop_token_ids": lambda v: isinstance(v, list) and all(isinstance(t, int) for t in v),
    "ignore_eos": lambda v: isinstance(v, bool),
}


def params_from_wire(value: Any) -> SamplingParams:
    """Raises ProtocolError for a wrong field, ValueError (from SamplingParams) for a bad value."""
    if not isinstance(value, dict):
        raise ProtocolError("field 'params' must be a map")
    kwargs: dict[str, Any] = {}
    for name, ok in _PARAM_FIELDS.items():
        if name in value:
            if not ok(value[name]) or (isinstance(value[name], bool) and name != "ignore_eos"):
                raise ProtocolError(f"field 'params.{name}' has the wrong type")
            kwargs[name] = value[name]
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise ProtocolError(f"params: {exc}") from None
