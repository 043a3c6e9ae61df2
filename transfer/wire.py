"""msgpack encoding of every internal message: the transfer layer's (metadata, KV handles, lease
messages) and the router's and nodes' (generation requests, prefill replies, decode frames). The one
wire module: typed objects everywhere else, msgpack only here, at the HTTP and NIXL edges.

Nothing is pickled, ever. Every decoder

* refuses input longer than its ``max_bytes`` before decoding (``msgpack.unpackb`` has no
  ``max_buffer_size``; only the streaming ``Unpacker`` does),
* decodes with explicit ``max_bin_len``/``max_str_len``/``max_array_len``/``max_map_len`` and
  ``max_ext_len=0`` (so a declared 4 GiB length fails before any allocation), ``strict_map_key``,
  ``raw=False``,
* checks the schema: a map with a protocol version ``v`` first, then every field's type, range and length,

and raises one `WireError` naming the message and field. Unknown extra fields are ignored (a newer
minor sender may add some); a different ``v`` raises `WireVersionError`.

    meta     {"v", "agent", "incarnation", "nixl_md": bin, "fingerprint": bin32,
              "tiers": [{"name", "mem", "dev", "base", "block_bytes", "stride", "num_blocks"}]}
    handle   {"v", "owner_agent", "owner_incarnation", "owner_url", "keys": [bin32], "tiers": [str],
              "block_ids": [int], "num_tokens", "lease_id", "lease_ttl_s"}
    notif    {"v", "kind": "done"|"abort", "lease_id"}             (NIXL notification, reader → owner)
    renew    {"v", "lease_id", "binding": bin32}  →  {"v", "ttl_s": float}   (POST /kv/lease/renew;
             binding: `KvHandle.binding` of the reader's handle, which the owner's lease must have)
    release  {"v", "lease_id"}  →  {"v", "released": bool}          (POST /kv/lease/release, from the router)

    generation request  {"request_id", "prompt", "params", "salt", "first_token_ids"?, "resume_token_ids"?,
                         "handle"?, "long_context"?}
    prefill reply       {"first_token_ids", "finish_reasons", "handle", "num_cached_tokens", "logprobs"?,
                         "prompt_logprobs"?: [[logprob, rank, [[token id, logprob], ...]], ...]}
    decode stream       frames {"index", "tokens", "finished", "reason", "num_cached_tokens"?} | {"error", "status"}

Router ↔ node messages are unversioned (one deployment runs one build) and share the node limits
(`MAX_BODY_BYTES`, `MAX_PROMPT_TOKENS`, `MAX_SALT_BYTES`, `MAX_TEXT_CHARS`, `MAX_PROMPT_LOGPROB_VALUES`). No
torch here: the router imports this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.model.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    PromptTokenLogprobs,
    SamplingParams,
    TokenLogprobs,
)
from kvrelay.model.structured import StructuredOutput
from kvrelay.transfer.handle import BINDING_BYTES, KvHandle
from kvrelay.transfer.lease import TierBlock
from kvrelay.transfer.metadata import PROTOCOL_VERSION, AgentMeta, TierRegion

MAX_META_BYTES = 4 << 20
MAX_NIXL_METADATA_BYTES = 2 << 20
MAX_HANDLE_BYTES = 8 << 20
MAX_BLOCKS_PER_HANDLE = 1 << 16
MAX_SMALL_MESSAGE_BYTES = 1024
MAX_NAME_CHARS = 128
MAX_URL_CHARS = 2048
MAX_LEASE_ID_CHARS = 64
MAX_TIERS = 8
MAX_POOL_BLOCKS = 1 << 31
KEY_BYTES = 32
NOTIF_KINDS = ("done", "abort")


class WireError(ValueError):
    """A malformed or oversized message; the text names the message and the field."""


class WireVersionError(WireError):
    """A well-formed message of another protocol version."""

    def __init__(self, what: str, version: int) -> None:
        super().__init__(f"{what}: protocol version {version}, this node speaks {PROTOCOL_VERSION}")
        self.version = version


@dataclass(frozen=True, slots=True)
class LeaseNotif:
    """A reader's word on a lease: ``done`` (READ complete) or ``abort`` (gave up); both unpin."""

    kind: str
    lease_id: str


@dataclass(frozen=True, slots=True)
class RenewRequest:
    """A reader's renewal: the lease, and the binding of the handle it holds (`transfer.handle.binding_of`)."""

    lease_id: str
    binding: bytes


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: Any, what: str, *, max_bytes: int, max_array_len: int, max_bin_len: int) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError(f"{what}: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, max_bin_len=max_bin_len,
            max_str_len=MAX_URL_CHARS, max_array_len=max_array_len, max_map_len=32, max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # StackError, ExtraData are ValueErrors
        raise WireError(f"{what}: malformed msgpack ({type(exc).__name__}: {str(exc)[:200]})") from None
    return _check_version(obj, what)


def _check_version(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WireError(f"{what}: expected a map, got {type(obj).__name__}")
    version = _field(obj, "v", int, what)
    if version != PROTOCOL_VERSION:
        raise WireVersionError(what, version)
    return obj


def _field(msg: dict[str, Any], name: str, kind: type, what: str) -> Any:
    if name not in msg:
        raise WireError(f"{what}.{name}: missing")
    value = msg[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"{what}.{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _int(msg: dict[str, Any], name: str, what: str, lo: int, hi: int) -> int:
    value = _field(msg, name, int, what)
    if not lo <= value < hi:
        raise WireError(f"{what}.{name}: {value} is outside [{lo}, {hi})")
    return value


def _str(msg: dict[str, Any], name: str, what: str, max_chars: int) -> str:
    value = _field(msg, name, str, what)
    if not 0 < len(value) <= max_chars:
        raise WireError(f"{what}.{name}: length {len(value)} is outside [1, {max_chars}]")
    return value


def _seconds(msg: dict[str, Any], name: str, what: str) -> float:
    value = _field(msg, name, float, what)
    if not (math.isfinite(value) and 0 < value <= 86400):
        raise WireError(f"{what}.{name}: {value} is not a duration in (0, 86400] seconds")
    return value


# ------------------------------------------------------------------ metadata
def encode_meta(meta: AgentMeta) -> bytes:
    return _pack({
        "v": meta.version, "agent": meta.agent_name, "incarnation": meta.incarnation,
        "nixl_md": meta.nixl_metadata, "fingerprint": meta.spec_fingerprint,
        "tiers": [{"name": t.name, "mem": t.mem_type, "dev": t.device_id, "base": t.base_addr,
                   "block_bytes": t.block_bytes, "stride": t.block_stride_bytes, "num_blocks": t.num_blocks}
                  for t in meta.tiers],
    })


def decode_meta(data: Any) -> AgentMeta:
    """Decode a ``/kv/meta`` body. Raises WireError (WireVersionError for another version)."""
    what = "kv meta"
    msg = _unpack(data, what, max_bytes=MAX_META_BYTES, max_array_len=MAX_TIERS,
                  max_bin_len=MAX_NIXL_METADATA_BYTES)
    fingerprint = _field(msg, "fingerprint", bytes, what)
    if len(fingerprint) != KEY_BYTES:
        raise WireError(f"{what}.fingerprint: {len(fingerprint)} bytes, expected {KEY_BYTES}")
    nixl_md = _field(msg, "nixl_md", bytes, what)
    if not nixl_md:
        raise WireError(f"{what}.nixl_md: empty")
    tiers_raw = _field(msg, "tiers", list, what)
    tiers: list[TierRegion] = []
    for i, raw in enumerate(tiers_raw):
        where = f"{what}.tiers[{i}]"
        if not isinstance(raw, dict):
            raise WireError(f"{where}: expected a map, got {type(raw).__name__}")
        mem = _str(raw, "mem", where, 8)
        if mem not in ("DRAM", "VRAM"):
            raise WireError(f"{where}.mem: {mem!r} is not DRAM or VRAM")
        block_bytes = _int(raw, "block_bytes", where, 1, 1 << 40)
        stride = _int(raw, "stride", where, block_bytes, 1 << 40)
        region = TierRegion(
            name=_str(raw, "name", where, MAX_NAME_CHARS), mem_type=mem, device_id=_int(raw, "dev", where, 0, 1 << 16),
            base_addr=_int(raw, "base", where, 1, 1 << 64), block_bytes=block_bytes, block_stride_bytes=stride,
            num_blocks=_int(raw, "num_blocks", where, 1, MAX_POOL_BLOCKS),
        )
        if region.base_addr + region.num_blocks * stride > 1 << 64:
            raise WireError(f"{where}: the region runs past the end of the address space")
        if any(t.name == region.name for t in tiers):
            raise WireError(f"{where}.name: tier {region.name!r} is listed twice")
        tiers.append(region)
    return AgentMeta(
        version=PROTOCOL_VERSION, agent_name=_str(msg, "agent", what, MAX_NAME_CHARS),
        incarnation=_str(msg, "incarnation", what, MAX_NAME_CHARS), nixl_metadata=nixl_md,
        spec_fingerprint=fingerprint, tiers=tuple(tiers),
    )


# -------------------------------------------------------------------- handle
def handle_to_wire(handle: KvHandle) -> dict[str, Any]:
    """The handle as a msgpack-ready map (it travels inside the prefill response)."""
    return {
        "v": PROTOCOL_VERSION, "owner_agent": handle.owner_agent, "owner_incarnation": handle.owner_incarnation,
        "owner_url": handle.owner_url, "keys": [bytes(k) for k in handle.keys],
        "tiers": [b.tier for b in handle.blocks], "block_ids": [b.block_id for b in handle.blocks],
        "num_tokens": handle.num_tokens, "lease_id": handle.lease_id, "lease_ttl_s": handle.lease_ttl_s,
        "digests": list(handle.digests),
    }


def encode_handle(handle: KvHandle) -> bytes:
    return _pack(handle_to_wire(handle))


def decode_handle(data: Any) -> KvHandle:
    """Decode an encoded handle. Raises WireError."""
    msg = _unpack(data, "kv handle", max_bytes=MAX_HANDLE_BYTES, max_array_len=MAX_BLOCKS_PER_HANDLE,
                  max_bin_len=KEY_BYTES)
    return handle_from_wire(msg)


def handle_from_wire(msg: Any) -> KvHandle:
    """Check an already-decoded handle map (e.g. a field of a decode request). Raises WireError."""
    what = "kv handle"
    msg = _check_version(msg, what)
    keys = _field(msg, "keys", list, what)
    tiers = _field(msg, "tiers", list, what)
    block_ids = _field(msg, "block_ids", list, what)
    if not 0 < len(keys) <= MAX_BLOCKS_PER_HANDLE:
        raise WireError(f"{what}.keys: {len(keys)} keys is outside [1, {MAX_BLOCKS_PER_HANDLE}]")
    if len(tiers) != len(keys) or len(block_ids) != len(keys):
        raise WireError(f"{what}: {len(keys)} keys but {len(tiers)} tiers and {len(block_ids)} block ids")
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise WireError(f"{what}.keys[{i}]: expected {KEY_BYTES} bytes")
    if len(set(keys)) != len(keys):
        raise WireError(f"{what}.keys: a key is listed twice")
    blocks: list[TierBlock] = []
    for i, (tier, block_id) in enumerate(zip(tiers, block_ids, strict=True)):
        if not isinstance(tier, str) or not 0 < len(tier) <= MAX_NAME_CHARS:
            raise WireError(f"{what}.tiers[{i}]: expected a tier name")
        if not isinstance(block_id, int) or isinstance(block_id, bool) or not 0 <= block_id < MAX_POOL_BLOCKS:
            raise WireError(f"{what}.block_ids[{i}]: expected an int in [0, {MAX_POOL_BLOCKS})")
        blocks.append(TierBlock(tier, block_id))
    digests = msg.get("digests", [])
    if not isinstance(digests, list) or len(digests) not in (0, len(keys)):
        raise WireError(f"{what}.digests: expected an empty list or one digest per key ({len(keys)})")
    for i, d in enumerate(digests):
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < 1 << 64:
            raise WireError(f"{what}.digests[{i}]: expected an int in [0, 2**64)")
    owner_url = _str(msg, "owner_url", what, MAX_URL_CHARS)
    if not owner_url.startswith(("http://", "https://")):
        raise WireError(f"{what}.owner_url: {owner_url[:80]!r} is not an http(s) URL")
    return KvHandle(
        owner_agent=_str(msg, "owner_agent", what, MAX_NAME_CHARS),
        owner_incarnation=_str(msg, "owner_incarnation", what, MAX_NAME_CHARS),
        owner_url=owner_url.rstrip("/"), keys=tuple(BlockKey(k) for k in keys), blocks=tuple(blocks),
        num_tokens=_int(msg, "num_tokens", what, 1, 1 << 40),
        lease_id=_str(msg, "lease_id", what, MAX_LEASE_ID_CHARS), lease_ttl_s=_seconds(msg, "lease_ttl_s", what),
        digests=tuple(digests),
    )


# ------------------------------------------------------------ lease messages
def encode_notif(kind: str, lease_id: str) -> bytes:
    assert kind in NOTIF_KINDS, kind
    return _pack({"v": PROTOCOL_VERSION, "kind": kind, "lease_id": lease_id})


def decode_notif(data: Any) -> LeaseNotif:
    what = "lease notification"
    msg = _unpack(data, what, max_bytes=MAX_SMALL_MESSAGE_BYTES, max_array_len=0, max_bin_len=0)
    kind = _str(msg, "kind", what, 8)
    if kind not in NOTIF_KINDS:
        raise WireError(f"{what}.kind: {kind!r} is not one of {NOTIF_KINDS}")
    return LeaseNotif(kind, _str(msg, "lease_id", what, MAX_LEASE_ID_CHARS))


def encode_lease_request(lease_id: str) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "lease_id": lease_id})


def encode_renew_request(lease_id: str, binding: bytes) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "lease_id": lease_id, "binding": bytes(binding)})


def decode_renew_request(data: Any) -> RenewRequest:
    """A renew request: the lease id and the binding of the reader's handle. Raises WireError."""
    what = "lease renew request"
    msg = _unpack(data, what, max_bytes=MAX_SMALL_MESSAGE_BYTES, max_array_len=0, max_bin_len=BINDING_BYTES)
    binding = _field(msg, "binding", bytes, what)
    if len(binding) != BINDING_BYTES:
        raise WireError(f"{what}.binding: expected {BINDING_BYTES} bytes, got {len(binding)}")
    return RenewRequest(_str(msg, "lease_id", what, MAX_LEASE_ID_CHARS), binding)


def decode_lease_request(data: Any) -> str:
    """The lease id of a release request. Raises WireError."""
    what = "lease request"
    msg = _unpack(data, what, max_bytes=MAX_SMALL_MESSAGE_BYTES, max_array_len=0, max_bin_len=0)
    return _str(msg, "lease_id", what, MAX_LEASE_ID_CHARS)


def encode_release_reply(released: bool) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "released": bool(released)})


def decode_release_reply(data: Any) -> bool:
    """Whether the owner still held the lease it was asked to release. Raises WireError."""
    what = "lease release reply"
    msg = _unpack(data, what, max_bytes=MAX_SMALL_MESSAGE_BYTES, max_array_len=0, max_bin_len=0)
    return _field(msg, "released", bool, what)


def encode_renew_reply(ttl_s: float) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "ttl_s": float(ttl_s)})


def decode_renew_reply(data: Any) -> float:
    """The lease's new ttl in seconds. Raises WireError."""
    what = "lease renew reply"
    msg = _unpack(data, what, max_bytes=MAX_SMALL_MESSAGE_BYTES, max_array_len=0, max_bin_len=0)
    return _seconds(msg, "ttl_s", what)


# --------------------------------------------------------------- HTTP bodies
async def read_body(content: aiohttp.StreamReader, *, max_bytes: int, what: str) -> bytes:
    """Read an HTTP body of at most ``max_bytes`` (whatever Content-Length claims). Raises WireError."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in content.iter_any():
        total += len(chunk)
        if total > max_bytes:
            raise WireError(f"{what}: body exceeds the {max_bytes}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


# -------------------------------------------------- router ↔ node messages
# A prefill or decode request, the prefill's reply, and decode's stream of frames. Unversioned: a
# deployment's router and nodes run one build. Decoded with the limits below, like every message here.
MAX_BODY_BYTES = 64 << 20
MAX_PROMPT_TOKENS = 4 << 20
MAX_SALT_BYTES = 1024
TENANT_SALT_BYTES = 16  # the router's per-API-key salt (`router.app.salt_for_key`); b"" without keys
MAX_TEXT_CHARS = 1 << 20  # request ids, error messages, long-context option values
MAX_NODE_MAP_LEN = 64
MAX_LOGIT_BIAS = 300  # (token id, bias) pairs in one request's params, as OpenAI allows
# logprobs in one prefill reply's prompt_logprobs, (P - 1) · (1 + top): at most ~15 bytes each, so a reply stays far
# under MAX_BODY_BYTES (the router refuses a request that would exceed it: `prompt_logprob_values`)
MAX_PROMPT_LOGPROB_VALUES = 1 << 21
_NODE_LIMITS: dict[str, int] = dict(max_bin_len=max(KEY_BYTES, MAX_SALT_BYTES), max_str_len=MAX_TEXT_CHARS,
                                    max_array_len=MAX_PROMPT_TOKENS, max_map_len=MAX_NODE_MAP_LEN, max_ext_len=0)


def pack(obj: Any) -> bytes:
    """msgpack of a plain value (maps, lists, ints, str, bytes); never pickle."""
    return _pack(obj)


def unpack(data: Any, what: str = "message") -> Any:
    """Decode one router ↔ node msgpack body with the node limits. Raises WireError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_BODY_BYTES:
        raise WireError(f"{what}: {len(data)} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, **_NODE_LIMITS)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"{what}: malformed msgpack ({type(exc).__name__}: {str(exc)[:200]})") from None


def new_unpacker() -> msgpack.Unpacker:
    """A streaming unpacker with the node limits (decode's framed token stream)."""
    return msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_BODY_BYTES, **_NODE_LIMITS)


def _opt(msg: dict[str, Any], name: str, kind: type, what: str) -> Any:
    return None if msg.get(name) is None else _field(msg, name, kind, what)


def _token_ids(msg: dict[str, Any], name: str, what: str, *, optional: bool = False) -> list[int] | None:
    value = _opt(msg, name, list, what) if optional else _field(msg, name, list, what)
    if value is None:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value):
        raise WireError(f"{what}.{name}: must be a list of token ids in [0, 2**32)")
    return value


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}  # shallow: structured_outputs below
    out["stop_token_ids"] = list(params.stop_token_ids)
    out["logit_bias"] = [[t, b] for t, b in params.logit_bias]
    out["allowed_token_ids"] = None if params.allowed_token_ids is None else list(params.allowed_token_ids)
    out["bad_words_token_ids"] = [list(w) for w in params.bad_words_token_ids]
    out["structured_outputs"] = (None if params.structured_outputs is None
                                 else params.structured_outputs.to_wire())
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bias_pairs(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_LOGIT_BIAS and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
        and _is_number(p[1]) for p in v)


_PARAM_FIELDS: dict[str, Callable[[Any], bool]] = {
    "max_tokens": lambda v: isinstance(v, int), "temperature": lambda v: isinstance(v, (int, float)),
    "top_p": lambda v: isinstance(v, (int, float)), "top_k": lambda v: isinstance(v, int),
    "seed": lambda v: v is None or isinstance(v, int), "n": lambda v: isinstance(v, int),
    "stop_token_ids": lambda v: isinstance(v, list) and all(isinstance(t, int) for t in v),
    "ignore_eos": lambda v: isinstance(v, bool),
    "presence_penalty": _is_number, "frequency_penalty": _is_number, "repetition_penalty": _is_number,
    "min_p": _is_number, "min_tokens": lambda v: isinstance(v, int), "logit_bias": _bias_pairs,
    "logprobs": lambda v: v is None or isinstance(v, int),
    "prompt_logprobs": lambda v: v is None or isinstance(v, int),
    "allowed_token_ids": lambda v: v is None or (isinstance(v, list) and len(v) <= MAX_ALLOWED_TOKEN_IDS
                                                 and all(isinstance(t, int) for t in v)),
    "bad_words_token_ids": lambda v: isinstance(v, list) and len(v) <= MAX_BAD_WORDS and all(
        isinstance(w, list) and 0 < len(w) <= MAX_BAD_WORD_TOKENS and all(isinstance(t, int) for t in w) for w in v),
}


def params_from_wire(value: Any, what: str = "params") -> SamplingParams:
    """Raises WireError for a field of the wrong type or a value `SamplingParams` refuses."""
    if not isinstance(value, dict):
        raise WireError(f"{what}: expected a map, got {type(value).__name__}")
    kwargs: dict[str, Any] = {}
    for name, ok in _PARAM_FIELDS.items():
        if name in value:
            if not ok(value[name]) or (isinstance(value[name], bool) and name != "ignore_eos"):
                raise WireError(f"{what}.{name}: has the wrong type")
            kwargs[name] = value[name]
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = tuple((t, float(b)) for t, b in kwargs["logit_bias"])
    if kwargs.get("allowed_token_ids") is not None:
        kwargs["allowed_token_ids"] = tuple(kwargs["allowed_token_ids"])
    if "bad_words_token_ids" in kwargs:
        kwargs["bad_words_token_ids"] = tuple(tuple(w) for w in kwargs["bad_words_token_ids"])
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if name in kwargs:
            kwargs[name] = float(kwargs[name])
    if value.get("structured_outputs") is not None:
        try:
            kwargs["structured_outputs"] = StructuredOutput.from_wire(value["structured_outputs"])
        except ValueError as exc:
            raise WireError(f"{what}.structured_outputs: {exc}") from None
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise WireError(f"{what}: {exc}") from None


@dataclass(frozen=True, slots=True)
class GenerationMessage:
    """A prefill (``/prefill``) or decode (``/generate``) request.

    ``handle``: the KV to pull (decode only). A handle that arrives malformed is not a malformed
    request: ``handle`` is then None and ``handle_error`` says why (decode counts it and recomputes).
    ``first_token_ids``: one per sample, sampled by the prefill node. ``resume_token_ids`` (decode only,
    instead): a request the router moved here from a decode node that failed mid-stream, per sample
    every token generated so far (none yet: empty), or None for a sample already finished.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    salt: bytes
    first_token_ids: list[int] | None = None
    handle: KvHandle | None = None
    long_context: dict[str, Any] | None = None  # the request's overrides of decode.long_context
    handle_error: str | None = None
    resume_token_ids: list[list[int] | None] | None = None


def encode_generation(msg: GenerationMessage) -> bytes:
    return _pack({
        "request_id": msg.request_id, "prompt": msg.prompt, "params": params_to_wire(msg.params), "salt": msg.salt,
        "first_token_ids": msg.first_token_ids, "handle": handle_to_wire(msg.handle) if msg.handle else None,
        "long_context": msg.long_context, "resume_token_ids": msg.resume_token_ids,
    })


def _handle_or_error(msg: dict[str, Any], what: str) -> tuple[KvHandle | None, str | None]:
    raw = msg.get("handle")
    if raw is None:
        return None, None
    try:
        return handle_from_wire(raw), None
    except WireError as exc:
        return None, str(exc)


def decode_generation(data: Any) -> GenerationMessage:
    """Decode and check a prefill/decode request body. Raises WireError naming the bad field."""
    what = "generation request"
    msg = unpack(data, what)
    if not isinstance(msg, dict):
        raise WireError(f"{what}: expected a map, got {type(msg).__name__}")
    salt = _field(msg, "salt", bytes, what)
    if len(salt) not in (0, TENANT_SALT_BYTES):  # only the router's derivation; never a client's choice
        raise WireError(f"{what}.salt: {len(salt)} bytes; a cache salt is empty or {TENANT_SALT_BYTES} bytes")
    handle, handle_error = _handle_or_error(msg, what)
    prompt = _token_ids(msg, "prompt", what)
    assert prompt is not None
    resumed = _opt(msg, "resume_token_ids", list, what)
    if resumed is not None:
        resumed = [None if s is None else _token_ids({"sample": s}, "sample", f"{what}.resume_token_ids")
                   for s in resumed]
        if len(prompt) + sum(len(s or ()) for s in resumed) > MAX_PROMPT_TOKENS:
            raise WireError(f"{what}.resume_token_ids: over {MAX_PROMPT_TOKENS} tokens with the prompt")
    return GenerationMessage(
        request_id=_str(msg, "request_id", what, MAX_TEXT_CHARS), prompt=prompt,
        params=params_from_wire(_field(msg, "params", dict, what), f"{what}.params"), salt=salt,
        first_token_ids=_token_ids(msg, "first_token_ids", what, optional=True), handle=handle,
        long_context=_opt(msg, "long_context", dict, what), handle_error=handle_error, resume_token_ids=resumed,
    )


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """A prefill node's answer: one first token per sample, why each sample already ended (None: decode
    continues it), the KV handle (None: nothing to pull), and how many prompt tokens came from cache.
    ``handle_error``: as in `GenerationMessage`."""

    first_token_ids: list[int]
    finish_reasons: list[str | None]
    handle: KvHandle | None
    num_cached_tokens: int
    handle_error: str | None = None
    first_logprobs: list[TokenLogprobs] | None = None  # one per first token, when the request asked
    # With a malformed handle: its lease id, when that much of it is readable, so the router can still
    # release the lease at once (nobody can pull a handle that does not parse).
    lease_id: str | None = None
    timings: dict[str, float] | None = None  # the node's stage timings in seconds (`check_timings`)
    # the prompt's logprobs, positions 1 to P - 1 (`PromptTokenLogprobs`), when the request asked
    prompt_logprobs: list[PromptTokenLogprobs] | None = None


def prompt_logprob_values(num_prompt_tokens: int, num_top: int) -> int:
    """How many logprobs a prompt of ``num_prompt_tokens`` tokens has with ``num_top`` top alternatives per position
    (the prompt's own token's included), to hold to `MAX_PROMPT_LOGPROB_VALUES`."""
    return max(0, num_prompt_tokens - 1) * (1 + num_top)


def encode_prefill_reply(reply: PrefillReply) -> bytes:
    return _pack({
        "first_token_ids": reply.first_token_ids, "finish_reasons": reply.finish_reasons,
        "handle": handle_to_wire(reply.handle) if reply.handle else None, "num_cached_tokens": reply.num_cached_tokens,
        "logprobs": _logprobs_to_wire(reply.first_logprobs), "timings": reply.timings,
        "prompt_logprobs": None if reply.prompt_logprobs is None else [
            [e.logprob, e.rank, [[t, v] for t, v in e.top]] for e in reply.prompt_logprobs],
    })


MAX_TIMINGS = 16


def check_timings(msg: dict[str, Any], what: str) -> dict[str, float] | None:
    """``timings``: nil, or at most `MAX_TIMINGS` stage names (``*_s``) with their seconds (finite, ≥ 0), as a
    node reports the stages of one request (`node.tracing.Stage`). Raises WireError."""
    raw = msg.get("timings")
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_TIMINGS or not all(
            isinstance(k, str) and k.endswith("_s") and len(k) <= MAX_NAME_CHARS and _is_number(v)
            and 0 <= v < 1e9 for k, v in raw.items()):
        raise WireError(f"{what}.timings: expected at most {MAX_TIMINGS} names ending in _s with seconds ≥ 0")
    return {k: float(v) for k, v in raw.items()}


def _logprobs_to_wire(logprobs: list[TokenLogprobs] | None) -> list[Any] | None:
    return None if logprobs is None else [[lp.logprob, [[t, v] for t, v in lp.top]] for lp in logprobs]


def _logprobs_from_wire(msg: dict[str, Any], count: int, what: str) -> list[TokenLogprobs] | None:
    """``logprobs``: nil, or one ``[logprob, [[token id, logprob], ...]]`` per token (``count`` of them)."""
    raw = msg.get("logprobs")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != count:
        raise WireError(f"{what}.logprobs: expected one entry per token")
    out = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_number(entry[0]) and isinstance(entry[1], list)
                and len(entry[1]) <= MAX_LOGPROBS and all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                    and _is_number(p[1]) for p in entry[1])):
            raise WireError(f"{what}.logprobs: expected [logprob, [[token id, logprob], ...]] per token")
        out.append(TokenLogprobs(float(entry[0]), tuple((t, float(v)) for t, v in entry[1])))
    return out


def _prompt_logprobs_from_wire(msg: dict[str, Any], what: str) -> list[PromptTokenLogprobs] | None:
    """``prompt_logprobs``: nil, or one ``[logprob, rank, [[token id, logprob], ...]]`` per prompt position from 1,
    at most `MAX_PROMPT_LOGPROB_VALUES` logprobs in all."""
    raw = msg.get("prompt_logprobs")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise WireError(f"{what}.prompt_logprobs: expected a list")
    out = []
    values = 0
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3 and _is_number(entry[0])
                and isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 1
                and isinstance(entry[2], list) and len(entry[2]) <= MAX_LOGPROBS and all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                    and _is_number(p[1]) for p in entry[2])):
            raise WireError(f"{what}.prompt_logprobs: expected [logprob, rank ≥ 1, [[token id, logprob], ...]] "
                            "per position")
        values += 1 + len(entry[2])
        if values > MAX_PROMPT_LOGPROB_VALUES:
            raise WireError(f"{what}.prompt_logprobs: over {MAX_PROMPT_LOGPROB_VALUES} logprobs")
        out.append(PromptTokenLogprobs(float(entry[0]), entry[1], tuple((t, float(v)) for t, v in entry[2])))
    return out


def decode_prefill_reply(data: Any) -> PrefillReply:
    """Raises WireError naming the bad field (a malformed handle only sets ``handle_error``)."""
    what = "prefill reply"
    msg = unpack(data, what)
    if not isinstance(msg, dict):
        raise WireError(f"{what}: expected a map, got {type(msg).__name__}")
    first = _token_ids(msg, "first_token_ids", what)
    assert first is not None
    reasons = _field(msg, "finish_reasons", list, what)
    if len(reasons) != len(first) or not all(r is None or isinstance(r, str) for r in reasons):
        raise WireError(f"{what}.finish_reasons: expected one reason (or nil) per first token")
    handle, handle_error = _handle_or_error(msg, what)
    lease_id = None
    raw = msg.get("handle")
    if handle_error is not None and isinstance(raw, dict):
        raw_id = raw.get("lease_id")
        if isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_LEASE_ID_CHARS:
            lease_id = raw_id
    return PrefillReply(first, reasons, handle, _int(msg, "num_cached_tokens", what, 0, 1 << 40), handle_error,
                        _logprobs_from_wire(msg, len(first), what), lease_id, check_timings(msg, what),
                        _prompt_logprobs_from_wire(msg, what))


@dataclass(frozen=True, slots=True)
class DecodeFrame:
    """One frame of decode's token stream: new tokens of sample ``index``."""

    index: int
    tokens: list[int]
    finished: bool
    reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    # the node's stage timings in seconds (`check_timings`), on the stream's first and last frames
    timings: dict[str, float] | None = None
    # prompt tokens the node took from its prefix cache (pulled KV included), on the stream's first frame
    num_cached_tokens: int | None = None


def encode_frame(frame: DecodeFrame) -> bytes:
    out = {"index": frame.index, "tokens": frame.tokens, "finished": frame.finished, "reason": frame.reason,
           "logprobs": _logprobs_to_wire(frame.logprobs)}
    if frame.timings is not None:
        out["timings"] = frame.timings
    if frame.num_cached_tokens is not None:
        out["num_cached_tokens"] = frame.num_cached_tokens
    return _pack(out)


def encode_error_frame(message: str, status: int) -> bytes:
    """The frame that ends a stream that failed after it started."""
    return _pack({"error": message, "status": status})


class StreamError(Exception):
    """An error frame: the node failed the request after its stream began."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def decode_frame(obj: Any) -> DecodeFrame:
    """Check one frame from `new_unpacker`. Raises StreamError for an error frame, WireError if malformed."""
    what = "decode frame"
    if not isinstance(obj, dict):
        raise WireError(f"{what}: expected a map, got {type(obj).__name__}")
    if "error" in obj:
        status = obj.get("status", 500)
        raise StreamError(status if isinstance(status, int) and 400 <= status < 600 else 500, str(obj["error"]))
    tokens = _token_ids(obj, "tokens", what)
    assert tokens is not None
    reason = _opt(obj, "reason", str, what)
    cached = (None if obj.get("num_cached_tokens") is None
              else _int(obj, "num_cached_tokens", what, 0, MAX_PROMPT_TOKENS))
    return DecodeFrame(_int(obj, "index", what, 0, 1 << 16), tokens, _field(obj, "finished", bool, what), reason,
                       _logprobs_from_wire(obj, len(tokens), what), check_timings(obj, what), cached)
