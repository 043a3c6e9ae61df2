"""The service sections of the YAML config: ``model``, ``engine``, ``internal``, ``prefill``,
``decode``, ``router``. Read by `deploy.config.load_config`; every error names its YAML key.

    model:    {path, name, dtype (auto | float32 | bfloat16 | float16), device}
    engine:   {max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching, attention_backend,
               cuda_graphs, cuda_graph_batch_sizes, stall_timeout_s}
              (attention_backend: torch | reference | triton; unset: triton on CUDA, torch on CPU; triton on
              CPU runs under Triton's interpreter, for tests. cuda_graphs (default true): capture decode steps
              on CUDA for cuda_graph_batch_sizes (default 1, 2, 4, 8, 16, … up to max_num_seqs).
              stall_timeout_s (default 60): an engine step (or pool call) that has not finished after this
              long, while the engine has work, marks the node stalled: /ready and /health answer 503, its
              requests end with 503, and the node exits to be restarted (`node.app`). Keep it above the
              longest legitimate step: a max_num_batched_tokens prefill chunk on a slow CPU, first-step
              kernel compiles.)
    internal: {bind, token, token_env, drain_timeout_s, keepalive_timeout_s, persist_timeout_s}
              (keepalive_timeout_s, default 75: an idle HTTP connection to a node is closed after it;
              persist_timeout_s, default 300: after the drain, the bound on writing the tiers to disk)
    prefill:  {ports: [8100, ...], lease_ttl_s, max_pending_requests, serve_whole_requests, devices: [0, ...],
               inject_faults: []}
              (devices: CUDA devices per node, for up; inject_faults: tests only, transfer.config.PUBLISH_FAULTS)
    decode:   {ports: [8200, ...], on_transfer_failure, max_pending_requests, transfer_timeout_s, devices,
               write_stall_timeout_s}
              (write_stall_timeout_s, default 60: a router that takes no frame of a stream for that long is cut
              off and the request aborted, its blocks freed)
    router:   {host, port, api_keys, api_keys_env, max_body_bytes, request_timeout_s, max_n, load_weight_tokens,
               max_concurrent_requests, max_connections_per_node, connect_timeout_s, prefill_urls, decode_urls,
               prefill_dns, decode_dns, dns_interval_s, max_queued_requests, max_queued_bytes, queue_timeout_s,
               decode_reserve_tokens, migration_limit, body_read_timeout_s, write_stall_timeout_s, keepalive_timeout_s,
               disaggregation, tpot_slo_s, ttft_slo_s, tool_call_parser, enable_auto_tool_choice,
               return_tokens_as_token_ids}
              (body_read_timeout_s, default 30: a request body not in within it gets 408, and holds no admission
              slot meanwhile; write_stall_timeout_s, default 30: a client that takes no write of its answer for
              that long is dropped and its request ended; keepalive_timeout_s, default 75: an idle client
              connection is closed after it)
    observability: {otlp_endpoint}
              (otlp_endpoint: an OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces, as vLLM's
              --otlp-traces-endpoint; unset: no spans are recorded or exported)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode.config import FAILURE_POLICIES
from deploy.sizes import ConfigError, parse_size
from engine.long_context import COUNTS, POLICIES, SELECTIONS, LongContextConfig
from model.dtype_names import AUTO, DTYPE_CHOICES
from router.plan import MODES as DISAGGREGATION_MODES
from router.tool_calls import PARSER_NAMES
from transfer.config import PUBLISH_FAULTS
from transfer.discovery import parse_dns_name


@dataclass(frozen=True, slots=True)
class ModelSection:
    path: str
    name: str
    dtype: str = "auto"  # weights; "auto": see model.dtype.resolve_dtype
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class EngineSection:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # model.attention.BACKEND_NAME_TO_CLASS; None: by device
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: engine.cuda_graphs.default_batch_sizes
    stall_timeout_s: float = 60.0  # node.app.NodeConfig.stall_timeout_s


@dataclass(frozen=True, slots=True)
class InternalSection:
    bind: str = "127.0.0.1"
    token: str | None = None
    drain_timeout_s: float = 30.0  # on SIGTERM: how long admitted requests may take to finish
    keepalive_timeout_s: float = 75.0  # an idle connection to a node is closed after this
    # after the drain: how long writing the device and host tiers to disk may take (`kvrelay up` waits too)
    persist_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class PrefillSection:
    ports: tuple[int, ...] = (8100,)
    lease_ttl_s: float = 30.0
    devices: tuple[str, ...] = ()  # per node, `kvrelay up` sets CUDA_VISIBLE_DEVICES to it; empty: inherited
    inject_faults: tuple[str, ...] = ()  # tests only: transfer.config.PUBLISH_FAULTS
    max_pending_requests: int = 256  # a bound the router's queue keeps below (it places by room)
    # also serve whole requests (`prefill.service.WholeRequestPrefillService`); the router uses it under auto
    serve_whole_requests: bool = False


@dataclass(frozen=True, slots=True)
class DecodeSection:
    ports: tuple[int, ...] = (8200,)
    on_transfer_failure: str = "recompute"
    max_pending_requests: int = 256
    transfer_timeout_s: float = 10.0
    long_context: LongContextConfig = LongContextConfig()
    devices: tuple[str, ...] = ()  # as PrefillSection.devices
    write_stall_timeout_s: float = 60.0  # decode.config.DecodeConfig.write_stall_timeout_s


@dataclass(frozen=True, slots=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1024 * 1024
    request_timeout_s: float = 300.0
    max_n: int = 4
    load_weight_tokens: int = 64
    prefill_urls: tuple[str, ...] = ()  # empty (and no prefill_dns): http://{internal.bind}:{port} per prefill port
    decode_urls: tuple[str, ...] = ()
    max_concurrent_requests: int = 16384
    max_connections_per_node: int = 1024
    connect_timeout_s: float = 5.0
    prefill_dns: tuple[str, ...] = ()  # host:port names (k8s headless Services): every address is a node
    decode_dns: tuple[str, ...] = ()
    dns_interval_s: float = 10.0
    max_queued_requests: int = 8192  # router.queue: requests waiting for room, their prompt bytes, their wait
    max_queued_bytes: int = 256 * 1024 * 1024
    queue_timeout_s: float = 300.0
    decode_reserve_tokens: int = 256
    migration_limit: int = 3  # times one request may move to another decode node mid-stream; 0: never
    body_read_timeout_s: float = 30.0  # router.config.RouterConfig
    write_stall_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0  # an idle client connection is closed after this (aiohttp's default: 3630)
    disaggregation: str = "auto"  # always | never | auto (router.plan)
    tpot_slo_s: float = 0.05  # under auto, a local prefill keeps the decode node's streams within it (0: none)
    ttft_slo_s: float = 0.0  # under auto, a plan whose predicted TTFT passes it counts as a breach (0: none)
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser (router.tool_calls); None: by model family
    enable_auto_tool_choice: bool = False  # vLLM's --enable-auto-tool-choice: tool_choice auto is parsed
    return_tokens_as_token_ids: bool = False  # vLLM's --return-tokens-as-token-ids: logprob tokens as token_id:N



@dataclass(frozen=True, slots=True)
class ObservabilitySection:
    otlp_endpoint: str | None = None  # OTLP over HTTP (kvrelay.tracing); None: tracing off, no cost


def _parser_name(v: Any) -> str:
    if v not in PARSER_NAMES:
        raise ValueError(f"is not a tool-call parser (--tool-call-parser): use one of {', '.join(PARSER_NAMES)}")
    return v

class Section:
    """Typed reads from one YAML mapping; each read removes its key so leftovers can be reported."""

    def __init__(self, raw: Any, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {type(raw).__name__}")
        self._raw = dict(raw)
        self.path = path

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def take(self, name: str, check: Callable[[Any], Any], default: Any) -> Any:
        if name not in self._raw or self._raw[name] is None:
            self._raw.pop(name, None)
            return default
        value = self._raw.pop(name)
        try:
            return check(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.key(name)}: {value!r} {exc}") from None

    def section(self, name: str) -> Section:
        return Section(self._raw.pop(name, None), self.key(name))

    def done(self) -> None:
        if self._raw:
            raise ConfigError(f"{self.key(sorted(self._raw)[0])}: unknown key")


def positive_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError("is not a positive integer")
    return v


def non_negative_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("is not an integer >= 0")
    return v


def positive_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError("is not a positive number")
    return float(v)


def non_negative_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise ValueError("is not a number >= 0")
    return float(v)


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("is not true or false")
    return v


def string(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("is not a non-empty string")
    return v


def one_of(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError(f"is not one of {list(options)}")
        return v

    return check


def _faults(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or any(f not in PUBLISH_FAULTS for f in v):
        raise ValueError(f"is not a list of {list(PUBLISH_FAULTS)}")
    return tuple(v)


def _batch_sizes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                                                     for s in v):
        raise ValueError("is not a non-empty list of positive integers")
    return tuple(sorted(set(v)))


def port_list(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 65536
                                          for p in v):
        raise ValueError("is not a list of TCP ports")
    return tuple(v)


def size(v: Any) -> int:
    return parse_size(v)


ATTENTION_BACKENDS = ("reference", "torch", "triton")  # model.attention.BACKEND_NAME_TO_CLASS (no torch here)
TOKEN_ENV = "KVRELAY_INTERNAL_TOKEN"  # the internal token when the config names none (`kvrelay up` sets it)
LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")


def internal_token_problem(internal: InternalSection) -> str | None:
    """Why a node with these ``internal`` settings must not start (fail closed), or None: an internal
    plane reachable from other machines needs the shared token."""
    if internal.token is None and internal.bind not in LOOPBACK_BINDS and not internal.bind.startswith("127."):
        return (f"internal.bind is {internal.bind!r} (reachable from other machines) but no internal token is "
                f"set: set internal.token_env to the name of a variable holding a secret, or {TOKEN_ENV}")
    return None


def _env(name: str | None, env: Mapping[str, str]) -> str | None:
    return env.get(name) if name else None


def parse_services(root: Section, *, base_dir: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read the service sections from ``root``; returns them by name. Relative paths resolve from ``base_dir``."""
    env = os.environ if env is None else env
    m = root.section("model")
    path = m.take("path", string, None)
    if path is None:
        raise ConfigError("model.path: required (a Hugging Face model directory)")
    model_path = Path(path) if Path(path).is_absolute() else base_dir / path
    model = ModelSection(str(model_path), m.take("name", string, model_path.name),
                         m.take("dtype", one_of(DTYPE_CHOICES), AUTO),
                         m.take("device", string, "cpu"))
    m.done()
    e = root.section("engine")
    engine = EngineSection(e.take("max_num_seqs", positive_int, 64),
                           e.take("max_num_batched_tokens", positive_int, 1024),
                           e.take("max_model_len", positive_int, None), e.take("enable_prefix_caching", boolean, True),
                           e.take("attention_backend", one_of(ATTENTION_BACKENDS), None),
                           e.take("cuda_graphs", boolean, True), e.take("cuda_graph_batch_sizes", _batch_sizes, None),
                           e.take("stall_timeout_s", positive_float, 60.0))
    if engine.cuda_graph_batch_sizes and max(engine.cuda_graph_batch_sizes) > engine.max_num_seqs:
        raise ConfigError(f"engine.cuda_graph_batch_sizes: {max(engine.cuda_graph_batch_sizes)} is above "
                          f"engine.max_num_seqs ({engine.max_num_seqs}); a step never holds that many sequences")
    e.done()
    i = root.section("internal")
    bind = i.take("bind", string, "127.0.0.1")
    token = (i.take("token", string, None) or _env(i.take("token_env", string, None), env)
             or env.get(TOKEN_ENV) or None)
    drain_timeout_s = i.take("drain_timeout_s", positive_float, 30.0)
    node_keepalive_s = i.take("keepalive_timeout_s", positive_float, 75.0)
    persist_timeout_s = i.take("persist_timeout_s", positive_float, 300.0)
    i.done()
    p = root.section("prefill")
    prefill_ports = p.take("ports", port_list, ())
    prefill = PrefillSection(prefill_ports, p.take("lease_ttl_s", positive_float, 30.0),
                             _devices(p, len(prefill_ports)), p.take("inject_faults", _faults, ()),
                             p.take("max_pending_requests", positive_int, 256),
                             p.take("serve_whole_requests", boolean, False))
    p.done()
    d = root.section("decode")
    decode_ports = d.take("ports", port_list, (8200,))
    if not decode_ports:
        raise ConfigError("decode.ports: at least one decode node is required")
    decode = DecodeSection(decode_ports,
                           d.take("on_transfer_failure", one_of(FAILURE_POLICIES), "recompute"),
                           d.take("max_pending_requests", positive_int, 256),
                           d.take("transfer_timeout_s", positive_float, 10.0),
                           _long_context(d.section("long_context")), _devices(d, len(decode_ports)),
                           d.take("write_stall_timeout_s", positive_float, 60.0))
    d.done()
    r = root.section("router")
    keys = r.take("api_keys", _string_list, ())
    env_keys = _env(r.take("api_keys_env", string, None), env)
    if env_keys:
        keys = keys + tuple(k.strip() for k in env_keys.split(",") if k.strip())
    router = RouterSection(r.take("host", string, "127.0.0.1"), r.take("port", _port, 8000), keys,
                           r.take("max_body_bytes", size, 1024 * 1024), r.take("request_timeout_s", positive_float,
                                                                                 300.0),
                           r.take("max_n", positive_int, 4), r.take("load_weight_tokens", positive_int, 64),
                           r.take("prefill_urls", _url_list, ()), r.take("decode_urls", _url_list, ()),
                           r.take("max_concurrent_requests", positive_int, 16384),
                           r.take("max_connections_per_node", positive_int, 1024),
                           r.take("connect_timeout_s", positive_float, 5.0),
                           r.take("prefill_dns", _dns_list, ()), r.take("decode_dns", _dns_list, ()),
                           r.take("dns_interval_s", positive_float, 10.0),
                           r.take("max_queued_requests", positive_int, 8192),
                           r.take("max_queued_bytes", size, 256 * 1024 * 1024),
                           r.take("queue_timeout_s", positive_float, 300.0),
                           r.take("decode_reserve_tokens", positive_int, 256),
                           r.take("migration_limit", non_negative_int, 3),
                           r.take("body_read_timeout_s", positive_float, 30.0),
                           r.take("write_stall_timeout_s", positive_float, 30.0),
                           r.take("keepalive_timeout_s", positive_float, 75.0),
                           r.take("disaggregation", one_of(DISAGGREGATION_MODES), "auto"),
                           r.take("tpot_slo_s", non_negative_float, 0.05),
                           r.take("ttft_slo_s", non_negative_float, 0.0),
                           r.take("tool_call_parser", _parser_name, None),
                           r.take("enable_auto_tool_choice", boolean, False),
                           r.take("return_tokens_as_token_ids", boolean, False))
    r.done()
    o = root.section("observability")
    observability = ObservabilitySection(o.take("otlp_endpoint", _http_url, None))
    o.done()
    internal = InternalSection(bind, token, drain_timeout_s, node_keepalive_s, persist_timeout_s)
    return {"model": model, "engine": engine, "internal": internal,
            "prefill": prefill, "decode": decode, "router": router, "observability": observability}


def _long_context(s: Section) -> LongContextConfig:
    """``decode.long_context``; whether the budget fits the block size is checked with the kvstore section."""
    default = LongContextConfig()
    fields: dict[str, Any] = {"policy": s.take("policy", one_of(POLICIES), default.policy),
                              "selection": s.take("selection", one_of(SELECTIONS), default.selection),
                              "speculation_alpha": s.take("speculation_alpha", _non_negative_float,
                                                          default.speculation_alpha),
                              "partial_channels_frac": s.take("partial_channels_frac", _unit_fraction,
                                                              default.partial_channels_frac)}
    for name in COUNTS:
        fields[name] = s.take(name, _count, getattr(default, name))
    s.done()
    try:
        return LongContextConfig(**fields)
    except ValueError as exc:
        raise ConfigError(f"decode.{exc}") from None


def _unit_fraction(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError("is not a number in (0, 1]")
    return float(v)


def _non_negative_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise ValueError("is not a finite number >= 0")
    return float(v)


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("is not an integer >= 0")
    return v


def _string_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ValueError("is not a list of non-empty strings")
    return tuple(v)


def _url_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in v):
        raise ValueError("is not a list of http:// URLs")
    return tuple(u.rstrip("/") for u in v)


def _http_url(v: Any) -> str:
    if not isinstance(v, str) or not v.startswith(("http://", "https://")):
        raise ValueError("is not an http:// or https:// URL")
    return v


def _devices(s: Section, num_nodes: int) -> tuple[str, ...]:
    """``<role>.devices``: one entry per node (its CUDA device index, or several as "0,1"), or none."""
    def check(v: Any) -> tuple[str, ...]:
        if not isinstance(v, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0
                or isinstance(d, str) and re.fullmatch(r"\d+(,\d+)*", d) for d in v):
            raise ValueError('is not a list of CUDA device indices (one per node; e.g. [0, 1] or ["0,1", "2,3"])')
        if len(v) != num_nodes:
            raise ValueError(f"has {len(v)} entries for {num_nodes} nodes (ports); give one per node")
        return tuple(str(d) for d in v)

    return s.take("devices", check, ())


def _dns_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise ValueError("is not a list of host:port names")
    for name in v:
        parse_dns_name(name)
    return tuple(v)


def _port(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 65536:
        raise ValueError("is not a TCP port")
    return v
