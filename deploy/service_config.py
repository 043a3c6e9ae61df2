"""The service sections of the YAML config (``model``, ``engine``, ``internal``, ``prefill``, ``decode``,
``router``, ``observability``) and `Section`, the typed reader every section is parsed with.

Every key, its check, default, unit and meaning is declared once in `deploy.config_keys`; the reference
generated from those declarations is ``docs/reference/configuration.md`` (``kvrelay config reference``).
Read by `deploy.config.load_config`; every error names its YAML key path.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.deploy.config_keys import ATTENTION_BACKENDS as ATTENTION_BACKENDS
from kvrelay.deploy.config_keys import KEYS, TOKEN_ENV, names_at
from kvrelay.deploy.sizes import ConfigError
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.model.hub import is_hub_id


@dataclass(frozen=True, slots=True)
class ModelSection:
    """``path``: an absolute local directory, or a hub repo id (``ORG/NAME``, `model.hub.is_hub_id`) that no local
    path answers to, until `deploy.model_source.resolve_config_model` gives its snapshot directory."""

    path: str
    name: str
    dtype: str = "auto"  # weights; "auto": see model.dtype.resolve_dtype
    device: str = "auto"  # "auto": see model.device.resolve_device (decided in each node)
    revision: str | None = None  # of a hub repo id; None: main
    download_dir: str | None = None  # the hub cache of a hub repo id; None: huggingface_hub's


@dataclass(frozen=True, slots=True)
class EngineSection:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefill_packing: str = "fill"  # engine.scheduler: whether a prompt joins a step another one finishes in
    kernel_plan: str = "auto"  # engine.kernel_tuning.PLAN_MODES
    deterministic: bool = False  # engine.engine_config.EngineConfig.deterministic
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # model.attention.BACKEND_NAME_TO_CLASS; None: by device
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: engine.cuda_graphs.default_batch_sizes
    stall_timeout_s: float = 60.0  # node.app.NodeConfig.stall_timeout_s
    pool_call_timeout_s: float = 30.0  # engine.worker.EngineWorker: the default bound of call / must_run
    grammar_compile_timeout_s: float = 5.0  # engine.engine_config.EngineConfig


@dataclass(frozen=True, slots=True)
class InternalSection:
    bind: str = "127.0.0.1"
    token: str | None = None
    drain_timeout_s: float = 30.0  # on SIGTERM: how long admitted requests may take to finish
    keepalive_timeout_s: float = 75.0  # an idle connection to a node is closed after this
    header_read_timeout_s: float = 10.0  # deploy.http_edge.EdgeLimits, for every node's HTTP server
    max_open_connections: int | None = None  # None: half the open-file limit
    # after the drain: how long writing the device and host tiers to disk may take (`kvrelay up` waits too)
    persist_timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class PrefillSection:
    ports: tuple[int, ...] = ()  # none: every prompt is computed on its decode node
    lease_ttl_s: float = 30.0
    devices: tuple[str, ...] = ()  # per node, `kvrelay up` sets CUDA_VISIBLE_DEVICES to it; empty: inherited
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
    max_buffered_body_bytes: int = 256 * 1024 * 1024
    write_stall_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0  # an idle client connection is closed after this (aiohttp's default: 3630)
    header_read_timeout_s: float = 10.0  # deploy.http_edge.EdgeLimits
    max_open_connections: int | None = None  # None: half the open-file limit
    disaggregation: str = "auto"  # always | never | auto (router.plan)
    tpot_slo_s: float = 0.05  # under auto, a local prefill keeps the decode node's streams within it (0: none)
    ttft_slo_s: float = 0.0  # under auto, a plan whose predicted TTFT passes it counts as a breach (0: none)
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser (router.tool_calls); None: by model family
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser (router.reasoning); None: no split
    max_grammar_bytes: int = 32 * 1024  # router.grammar_limits.GrammarLimits
    max_grammar_nesting: int = 64
    max_grammar_rules: int = 500
    max_grammar_alternatives: int = 2000
    max_compiling_requests_per_tenant: int = 16  # router.compile_budget.CompileBudgetConfig
    compile_budget_s: float = 30.0
    compile_budget_window_s: float = 60.0
    chat_template: str | None = None  # vLLM's --chat-template: a file or the Jinja source; None: the model's
    enable_auto_tool_choice: bool = False  # vLLM's --enable-auto-tool-choice: tool_choice auto is parsed
    return_tokens_as_token_ids: bool = False  # vLLM's --return-tokens-as-token-ids: logprob tokens as token_id:N
    generation_config: str = "auto"  # vLLM's --generation-config: auto (the model's defaults) | vllm



@dataclass(frozen=True, slots=True)
class ObservabilitySection:
    otlp_endpoint: str | None = None  # OTLP over HTTP (node.tracing); None: tracing off, no cost


class Section:
    """Typed reads from one YAML mapping at key path ``path``, through the declarations `deploy.config_keys.KEYS`.

    Each read removes its key so that `done` can report leftovers. ``taken`` is the set of key paths read
    through this section and its subsections (shared with them); only `take` adds to it.
    """

    def __init__(self, raw: Any, path: str, taken: set[str] | None = None) -> None:
        """Raises ConfigError: ``raw`` is neither a mapping nor null."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {type(raw).__name__}")
        self._raw = dict(raw)
        self.path = path
        self.taken: set[str] = set() if taken is None else taken

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def given(self, name: str) -> bool:
        """Whether key ``name`` is present and not null (before it is taken)."""
        return self._raw.get(name) is not None

    def take(self, name: str, *, fits: Callable[[Any], None] | None = None) -> Any:
        """The value of key ``name``, checked by its declared check; its declared default when absent or null.

        ``fits``: a further check of the raw value against keys read before (e.g. one device per port),
        raising ValueError as a check does.

        Raises:
            ConfigError: ``<key path>: <value!r> <the check's reason>``.
            KeyError: ``name`` is not declared in `deploy.config_keys.KEYS` (a bug, not a config error).
        """
        declared = KEYS[self.key(name)]
        self.taken.add(declared.path)
        if self._raw.get(name) is None:
            self._raw.pop(name, None)
            return declared.default
        value = self._raw.pop(name)
        try:
            checked = declared.check(value)
            if fits is not None:
                fits(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.key(name)}: {value!r} {exc}") from None
        return checked

    def section(self, name: str) -> Section:
        return Section(self._raw.pop(name, None), self.key(name), self.taken)

    def done(self) -> None:
        """Raises ConfigError naming the first key left unread, and the closest declared one at its level."""
        if self._raw:
            name = sorted(self._raw, key=str)[0]
            known = names_at(self.path)
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean {self.key(close[0])}?" if close else f"known keys here: {', '.join(known)}"
            raise ConfigError(f"{self.key(str(name))}: unknown key; {hint}")


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
    """Read the service sections from ``root``; returns them by name. Relative paths resolve from ``base_dir``;
    ``internal.token_env``, ``router.api_keys_env`` and `TOKEN_ENV` are read from ``env`` (default: os.environ).

    Raises:
        ConfigError: naming the key path of the first bad value or unknown key.
    """
    env = os.environ if env is None else env
    m = root.section("model")
    path = m.take("path")
    if path is None:
        raise ConfigError("model.path: required (a Hugging Face model directory, or a hub repo id ORG/NAME)")
    model_path = base_dir / Path(path).expanduser()  # an absolute path stays itself
    download_dir = m.take("download_dir")
    if is_hub_id(path) and not model_path.exists():  # a local path of that name wins (`model.hub`)
        model_path, default_name = Path(path), path
    else:
        default_name = model_path.name
    model = ModelSection(path=str(model_path), name=m.take("name") or default_name, dtype=m.take("dtype"),
                         device=m.take("device"), revision=m.take("revision"),
                         download_dir=str(base_dir / Path(download_dir).expanduser()) if download_dir else None)
    m.done()
    e = root.section("engine")  # each engine key (and each router key but the two below) is the field it sets
    engine = EngineSection(**{name: e.take(name) for name in names_at("engine")})
    if engine.cuda_graph_batch_sizes and max(engine.cuda_graph_batch_sizes) > engine.max_num_seqs:
        raise ConfigError(f"engine.cuda_graph_batch_sizes: {max(engine.cuda_graph_batch_sizes)} is above "
                          f"engine.max_num_seqs ({engine.max_num_seqs}); a step never holds that many sequences")
    e.done()
    i = root.section("internal")
    token, token_env = i.take("token"), i.take("token_env")
    internal = InternalSection(bind=i.take("bind"), token=token or _env(token_env, env) or env.get(TOKEN_ENV) or None,
                               drain_timeout_s=i.take("drain_timeout_s"),
                               keepalive_timeout_s=i.take("keepalive_timeout_s"),
                               header_read_timeout_s=i.take("header_read_timeout_s"),
                               max_open_connections=i.take("max_open_connections"),
                               persist_timeout_s=i.take("persist_timeout_s"))
    i.done()
    p = root.section("prefill")
    prefill_ports = p.take("ports")
    prefill = PrefillSection(ports=prefill_ports, lease_ttl_s=p.take("lease_ttl_s"),
                             devices=p.take("devices", fits=_one_per_node(len(prefill_ports))),
                             max_pending_requests=p.take("max_pending_requests"),
                             serve_whole_requests=p.take("serve_whole_requests"))
    p.done()
    d = root.section("decode")
    decode_ports = d.take("ports")
    if not decode_ports:
        raise ConfigError("decode.ports: at least one decode node is required")
    decode = DecodeSection(ports=decode_ports, on_transfer_failure=d.take("on_transfer_failure"),
                           max_pending_requests=d.take("max_pending_requests"),
                           transfer_timeout_s=d.take("transfer_timeout_s"),
                           long_context=_long_context(d.section("long_context")),
                           devices=d.take("devices", fits=_one_per_node(len(decode_ports))),
                           write_stall_timeout_s=d.take("write_stall_timeout_s"))
    d.done()
    r = root.section("router")
    keys = r.take("api_keys")
    env_keys = _env(r.take("api_keys_env"), env)
    if env_keys:
        keys = keys + tuple(k.strip() for k in env_keys.split(",") if k.strip())
    router = RouterSection(api_keys=keys, **{name: r.take(name) for name in names_at("router")
                                             if name not in ("api_keys", "api_keys_env")})
    r.done()
    o = root.section("observability")
    observability = ObservabilitySection(otlp_endpoint=o.take("otlp_endpoint"))
    o.done()
    return {"model": model, "engine": engine, "internal": internal,
            "prefill": prefill, "decode": decode, "router": router, "observability": observability}


def _long_context(s: Section) -> LongContextConfig:
    """``decode.long_context``; whether the budget fits the block size is checked with the kvstore section."""
    fields = {name: s.take(name) for name in names_at(s.path)}  # each key is the LongContextConfig field it sets
    s.done()
    try:
        return LongContextConfig(**fields)
    except ValueError as exc:
        raise ConfigError(f"decode.{exc}") from None


def _one_per_node(num_nodes: int) -> Callable[[Any], None]:
    """``<role>.devices``: one entry per node (port), or none."""
    def fits(v: list[Any]) -> None:
        if v and len(v) != num_nodes:
            raise ValueError(f"has {len(v)} entries for {num_nodes} nodes (ports); give one per node")

    return fits
