"""`RouterConfig`: the router's settings (the YAML ``router`` section, resolved), checked at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kvstore.checks import require_int
from kvrelay.router.compile_budget import CompileBudgetConfig
from kvrelay.router.grammar_limits import GrammarLimits
from kvrelay.router.harmony import ALL_REASONING_PARSERS
from kvrelay.router.plan import MODES
from kvrelay.router.tool_calls import PARSER_NAMES
from kvrelay.transfer.discovery import parse_dns_name


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router settings. ``api_keys`` empty: no authentication and one shared cache salt."""

    model_name: str
    model_dir: str
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    # host:port names whose every address is a node (a k8s headless Service), re-resolved every dns_interval_s
    prefill_dns: tuple[str, ...] = ()
    decode_dns: tuple[str, ...] = ()
    dns_interval_s: float = 10.0
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1024 * 1024
    request_timeout_s: float = 300.0  # counted from placement (`router.deadline`); the wait has queue_timeout_s
    max_n: int = 4
    internal_token: str | None = None
    load_weight_tokens: int = 64
    event_poll_interval_s: float = 0.1  # least time between two event requests to one node
    event_wait_s: float = 2.0  # how long a node may hold an event request that has no news
    node_retry_s: float = 5.0
    startup_timeout_s: float = 120.0
    max_concurrent_requests: int = 16384  # connections admitted at once (queued or running); more get 429
    max_queued_requests: int = 8192  # generation requests waiting for room (`router.queue`)
    max_queued_bytes: int = 256 * 1024 * 1024  # their prompts as held (4 B a token, 73 a block key)
    queue_timeout_s: float = 300.0  # how long one may wait for room; a longer predicted wait is a 429 at once
    decode_reserve_tokens: int = 256  # output tokens a decode node's room is reserved for, at most
    max_connections_per_node: int = 1024  # pooled request connections to each node
    connect_timeout_s: float = 5.0  # the TCP connect to a node (not the wait for a pooled connection)
    node_keepalive_timeout_s: float = 75.0  # the nodes' idle-connection timeout (internal.keepalive_timeout_s)
    migration_limit: int = 3  # times one request may move to another decode node mid-stream (`router.dispatch`)
    # always: every prompt prefilled on a prefill node (when one is up); never: on its decode node; auto: the plan
    # `router.plan` predicts cheaper from the nodes' measured rates
    disaggregation: str = "auto"
    # The TPOT SLO (seconds per output token) a local prefill must keep the decode node's streams within
    # under ``auto`` (`router.plan.tpot_breaches`); 0: not considered.
    tpot_slo_s: float = 0.05
    # The TTFT SLO (seconds) a plan's calibrated TTFT is held to under ``auto`` (`router.plan.choose_plan`); 0: none.
    ttft_slo_s: float = 0.0
    # A client's whole request body must arrive within this (else 408); no admission slot is held meanwhile.
    body_read_timeout_s: float = 30.0
    # The bytes of request bodies being read or parsed at once, all clients (`router.body_buffer`); more: 503.
    max_buffered_body_bytes: int = 256 * 1024 * 1024
    # A client that takes longer than this to take one write of its answer (it stopped reading) is dropped,
    # and its request ended on the nodes.
    write_stall_timeout_s: float = 30.0
    long_context: LongContextConfig = LongContextConfig()  # the decode nodes' default (decode.long_context)
    # vLLM's flags. tool_choice "auto" (the default with tools) parses the output for calls only when enabled, with
    # this parser (`router.tool_calls`; None: the one the model's chat template or family implies).
    tool_call_parser: str | None = None
    # router.reasoning.REASONING_PARSERS, or openai_gptoss (gpt-oss's harmony: `router.harmony`, also taken for a
    # gpt_oss model without it); None: chat content is all the text
    reasoning_parser: str | None = None
    chat_template: str | None = None  # a file or Jinja source in place of the model's (vLLM's --chat-template)
    enable_auto_tool_choice: bool = False
    return_tokens_as_token_ids: bool = False  # the default of the request field (logprobs' tokens as "token_id:N")
    # vLLM's --generation-config: auto (the model's generation_config.json gives the defaults of the sampling
    # fields a request leaves out: `model.generation_config`) | vllm (vLLM's neutral defaults)
    generation_config: str = "auto"
    grammar_limits: GrammarLimits = GrammarLimits()  # bounds on an EBNF grammar a request carries (max_grammar_*)
    compile_budget: CompileBudgetConfig = CompileBudgetConfig()  # new constraints per tenant (`router.compile_budget`)

    def __post_init__(self) -> None:
        """Raises ValueError naming the field (as in the YAML ``router`` section)."""
        for url in (*self.prefill_urls, *self.decode_urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"node URLs must start with http:// or https://, got {url!r}")
        for name in (*self.prefill_dns, *self.decode_dns):
            parse_dns_name(name)
        if not (self.decode_urls or self.decode_dns) and (self.prefill_urls or self.prefill_dns):
            raise ValueError("prefill nodes need at least one decode node (decode_urls and decode_dns are empty)")
        require_int("port", self.port, minimum=0, maximum=65535)
        require_int("max_body_bytes", self.max_body_bytes)
        require_int("max_buffered_body_bytes", self.max_buffered_body_bytes)
        require_int("max_n", self.max_n)
        require_int("load_weight_tokens", self.load_weight_tokens, minimum=0)
        require_int("max_concurrent_requests", self.max_concurrent_requests)
        require_int("max_connections_per_node", self.max_connections_per_node)
        require_int("max_queued_requests", self.max_queued_requests)
        require_int("max_queued_bytes", self.max_queued_bytes)
        require_int("decode_reserve_tokens", self.decode_reserve_tokens)
        require_int("migration_limit", self.migration_limit, minimum=0)
        if self.reasoning_parser is not None and self.reasoning_parser not in ALL_REASONING_PARSERS:
            raise ValueError(f"reasoning_parser (--reasoning-parser) must be one of {', '.join(ALL_REASONING_PARSERS)}"
                             f", got {self.reasoning_parser!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(f"tool_call_parser (--tool-call-parser) must be one of {', '.join(PARSER_NAMES)}, got "
                             f"{self.tool_call_parser!r}")
        if self.disaggregation not in MODES:
            raise ValueError(f"disaggregation must be one of {', '.join(MODES)}, got {self.disaggregation!r}")
        for name in ("request_timeout_s", "node_retry_s", "startup_timeout_s", "connect_timeout_s", "dns_interval_s",
                     "queue_timeout_s", "body_read_timeout_s", "write_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not (self.tpot_slo_s >= 0 and math.isfinite(self.tpot_slo_s)):
            raise ValueError(f"tpot_slo_s must be >= 0 seconds (0: none), got {self.tpot_slo_s!r}")
        if not (self.ttft_slo_s >= 0 and math.isfinite(self.ttft_slo_s)):
            raise ValueError(f"ttft_slo_s must be >= 0 seconds (0: none), got {self.ttft_slo_s!r}")
        if not self.event_poll_interval_s >= 0:
            raise ValueError(f"event_poll_interval_s must be >= 0 seconds, got {self.event_poll_interval_s!r}")
        if not 0 <= self.event_wait_s <= 30:  # what a node accepts as /kv/events?wait_s
            raise ValueError(f"event_wait_s must be in [0, 30] seconds, got {self.event_wait_s!r}")
