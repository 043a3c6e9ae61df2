"""Every key of the YAML config, declared once: its check, default, unit and meaning.

The parsers read values only through these declarations (`deploy.service_config.Section.take` looks a key up
by its path, so an undeclared key cannot be read), and `deploy.config_reference` renders them as
``docs/reference/configuration.md`` (``kvrelay config reference``). A key's value lands in the dataclass field
`Key.attr` of `deploy.config.Config` (``kvstore.device.bytes`` → ``kvstore.device.size_bytes``); a key without a
field of its own names the key it ``feeds`` (``internal.token_env`` → ``internal.token``).
``tests/deploy/test_config_reference.py`` holds the two together: every dataclass field is some key's ``attr``,
every declared default equals the field's default, and the parser reads exactly these keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvrelay.decode.config import FAILURE_POLICIES
from kvrelay.deploy.config_checks import (
    Check,
    admission,
    batch_sizes,
    boolean,
    chat_template,
    device_list,
    device_name,
    dns_list,
    finite_non_negative_float,
    fraction,
    http_url,
    integrity,
    non_negative_float,
    non_negative_int,
    one_of,
    port,
    port_list,
    positive_float,
    positive_int,
    size,
    string,
    string_list,
    tier_policy,
    unit_fraction,
    url_list,
)
from kvrelay.engine.long_context import POLICIES, SELECTIONS, LongContextConfig
from kvrelay.kvstore.digest import DEFAULT_INTEGRITY, DEFAULT_SAMPLE_RATE
from kvrelay.kvstore.policy import DEFAULT_POLICY
from kvrelay.model.dtype_names import AUTO, DTYPE_CHOICES, DTYPE_NAMES
from kvrelay.model.generation_config import GENERATION_CONFIG_MODES
from kvrelay.router.harmony import ALL_REASONING_PARSERS
from kvrelay.router.plan import MODES as DISAGGREGATION_MODES
from kvrelay.router.tool_calls import PARSER_NAMES

ATTENTION_BACKENDS = ("reference", "torch", "triton")  # model.attention.BACKEND_NAME_TO_CLASS (no torch here)
TOKEN_ENV = "KVRELAY_INTERNAL_TOKEN"  # the internal token when the config names none (`kvrelay up` sets it)


@dataclass(frozen=True, slots=True)
class Key:
    """One YAML key.

    Attributes:
        path: the dotted key path, e.g. ``kvstore.device.bytes``.
        check: converts and validates the value (`deploy.config_checks`).
        default: the value when the key is absent or null.
        doc: one sentence: what the value does.
        unit: of the number (``s``, ``bytes``, ``tokens``, ...); empty for none.
        field: the dataclass field, where it is not named as the key.
        feeds: for a key without a field of its own: the key path whose value it supplies.
        default_text: the default in words, where it is computed when a node starts or from other keys.
        also: constraints across keys, checked after the reads (added to the check's ``allowed``).
        secret: redacted by ``kvrelay config show``.
    """

    path: str
    check: Check
    default: Any
    doc: str
    unit: str = ""
    field: str | None = None
    feeds: str | None = None
    default_text: str | None = None
    also: str = ""
    secret: bool = False

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def section(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def attr(self) -> str | None:
        """The attribute path of the value in `deploy.config.Config`; None for a key that ``feeds`` another."""
        return None if self.feeds is not None else f"{self.section}.{self.field or self.name}"

    @property
    def allowed(self) -> str:
        return f"{self.check.allowed}; {self.also}" if self.also else self.check.allowed


# Section path → what it configures; YAML order (the reference's order).
SECTIONS: Mapping[str, str] = MappingProxyType({
    "model": "The model every node serves.",
    "kvstore": "The tiered KV store of every engine node: blocks, dtype and integrity checks.",
    "kvstore.device": "The device tier (GPU memory on CUDA, host memory on CPU); sized when a node starts.",
    "kvstore.host": "The host-memory tier; absent when neither bytes nor fraction_of_free is set.",
    "kvstore.disk": "The disk tier (one LMDB environment per node, in `path/<node>`); absent without path and "
                    "bytes.",
    "engine": "The engine loop of every prefill and decode node.",
    "internal": "The internal HTTP plane between router, prefill and decode nodes.",
    "prefill": "The prefill nodes: they compute prompts and publish their KV blocks.",
    "decode": "The decode nodes: they pull a prompt's KV blocks and generate.",
    "decode.long_context": "How a decoding sequence keeps its KV within a device budget; requests override it "
                           'with `{"kvrelay": {"long_context": {...}}}`.',
    "router": "The OpenAI-compatible front end: admission, queueing, placement and node discovery.",
    "observability": "Tracing.",
})

_LC = LongContextConfig()
_DEVICES = ("CUDA devices per node: `kvrelay up` sets each node's CUDA_VISIBLE_DEVICES to its entry; empty: "
            "inherited.")
_POLICY = "Which blocks leave this tier first: cold-tail (far tails of new prompts) or lru."
_BELOW_2_31 = "< 2^31"


def _table(*keys: Key) -> Mapping[str, Key]:
    out: dict[str, Key] = {}
    for key in keys:
        assert key.path not in out and key.section in SECTIONS, key.path
        out[key.path] = key
    return MappingProxyType(out)


KEYS: Mapping[str, Key] = _table(
    # ------------------------------------------------------------------ model
    Key("model.path", string, None, "A Hugging Face model directory (config.json, safetensors shards, "
        "tokenizer.json), or a Hugging Face Hub repo id ORG/NAME that is not a local path: fetched once into the "
        "hub cache (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply) and served from there; relative paths resolve from "
        "the working directory.", default_text="required"),
    Key("model.name", string, None, "The model name clients pass as `model`.",
        default_text="the directory's name; for a hub repo id, the id"),
    Key("model.revision", string, None, "For a hub repo id: the branch, tag or commit to serve (vLLM's "
        "--revision).", default_text="main"),
    Key("model.download_dir", string, None, "For a hub repo id: the hub cache it is read from and fetched into "
        "(vLLM's --download-dir); relative paths resolve from the working directory.",
        default_text="huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub"),
    Key("model.dtype", one_of(DTYPE_CHOICES), AUTO, "The weights dtype; auto: bfloat16 on CUDA and on CPUs with "
        "AMX / AVX512-BF16, float32 elsewhere."),
    Key("model.device", device_name, "auto", "Where the nodes compute: auto (CUDA when the node sees a GPU, "
        "else the CPU), cpu, cuda or cuda:N."),
    # ---------------------------------------------------------------- kvstore
    Key("kvstore.block_size_tokens", positive_int, 16, "Tokens per KV block: the unit of allocation, hashing, "
        "tiering and transfer.", unit="tokens"),
    Key("kvstore.dtype", one_of(DTYPE_NAMES), None, "The KV dtype.", default_text="the weights dtype"),
    Key("kvstore.integrity", integrity, DEFAULT_INTEGRITY, "Where blocks land (a tier move, a transfer) their "
        "digests are checked: never, for a sample, or for all."),
    Key("kvstore.integrity_sample_rate", fraction, DEFAULT_SAMPLE_RATE, "With integrity sampled: the share of "
        "landed blocks checked.", unit="fraction"),
    Key("kvstore.device.bytes", size, None, "The device tier's size.", unit="bytes",
        field="size_bytes", also="not with fraction_of_free or gpu_memory_utilization"),
    Key("kvstore.device.fraction_of_free", fraction, None, "The device tier as a share of the memory free when "
        "the node starts: GPU memory (read through NVML) on CUDA, the node's share of host memory on CPU.",
        unit="fraction", field="free_memory_frac", default_text="0.2 on CPU, 0.85 on CUDA",
        also="not with bytes or gpu_memory_utilization"),
    Key("kvstore.device.gpu_memory_utilization", fraction, None, "On CUDA, the share of the GPU's total memory "
        "the node may use in all, as vLLM's --gpu-memory-utilization: the device tier gets what is left after "
        "the weights and an activation reserve. Per node: nodes sharing a GPU split it. Ignored on a CPU device "
        "(the node says so and the tier takes its CPU default).", unit="fraction",
        also="not with bytes or fraction_of_free; nodes sharing a GPU sum to <= 1"),
    Key("kvstore.device.policy", tier_policy, DEFAULT_POLICY, _POLICY),
    Key("kvstore.host.bytes", size, None, "The host tier's size.", unit="bytes", field="size_bytes",
        also="not with fraction_of_free"),
    Key("kvstore.host.fraction_of_free", fraction, None, "The host tier as a share of the host memory free when "
        "the node starts (its share of it under `kvrelay up`).", unit="fraction", field="free_memory_frac",
        also="not with bytes"),
    Key("kvstore.host.policy", tier_policy, DEFAULT_POLICY, _POLICY, also="only with a host tier"),
    Key("kvstore.disk.path", string, None, "The disk tier's directory (each node writes `path/<node>`); "
        "relative paths resolve from the working directory.", also="required with bytes"),
    Key("kvstore.disk.bytes", size, None, "The disk tier's capacity.", unit="bytes", field="size_bytes",
        also="required with path"),
    Key("kvstore.disk.admit", admission, "all", "Which blocks leaving the host tier are written to disk: all, or "
        "those seen in at least N prompts."),
    Key("kvstore.disk.policy", tier_policy, DEFAULT_POLICY, _POLICY, also="only with a disk tier"),
    # ----------------------------------------------------------------- engine
    Key("engine.max_num_seqs", positive_int, 64, "The most sequences one engine step runs.", unit="sequences"),
    Key("engine.max_num_batched_tokens", positive_int, 1024, "The most tokens one engine step computes (the "
        "prefill chunk).", unit="tokens"),
    # the choices of engine.scheduler.PREFILL_PACKINGS, not imported: the router loads this module without torch
    Key("engine.prefill_packing", one_of(("fill", "priced")), "fill", "Whether a prompt joins a step in which "
        "another prompt's prefill ends: fill (up to max_num_batched_tokens), or priced (only when it ends there too "
        "and, by the measured step cost, the delay it puts on the others' first token is less than the step it "
        "saves itself and the prompts behind it)."),
    # the modes of engine.kernel_tuning.PLAN_MODES, not imported: the router loads this module without torch
    Key("engine.kernel_plan", one_of(("auto", "measure", "builtin")), "auto", "Which CPU kernel path each part of "
        "a step takes: auto (timed on this machine at the first start and kept per CPU model, model and build), "
        "measure (timed again now), or builtin (the fixed rule, nothing timed)."),
    Key("engine.deterministic", boolean, False, "Outputs that do not depend on what else is batched, how a prompt "
        "is chunked, which node computed its KV or whether its stream moved: every step takes kernels whose bits "
        "do not change with the batch (in place of engine.kernel_plan's), at a cost in speed. Dense bf16 or "
        "float32 models on the CPU; no long-context policy."),
    Key("engine.max_model_len", positive_int, None, "The longest sequence, prompt and output together.",
        unit="tokens", default_text="the model's context window"),
    Key("engine.enable_prefix_caching", boolean, True, "Reuse the KV blocks of prompt prefixes computed before."),
    Key("engine.attention_backend", one_of(ATTENTION_BACKENDS), None, "The attention kernels; triton on CPU runs "
        "under Triton's interpreter (for tests).", default_text="triton on CUDA, torch on CPU"),
    Key("engine.cuda_graphs", boolean, True, "On CUDA, capture decode steps as CUDA graphs (false: every step "
        "runs eagerly)."),
    Key("engine.cuda_graph_batch_sizes", batch_sizes, None, "The batch sizes whose decode steps are captured.",
        unit="sequences", default_text="1, 2, 4, 8, 16, … up to max_num_seqs", also="each <= max_num_seqs"),
    Key("engine.stall_timeout_s", positive_float, 60.0, "A step (or pool call) still running after this while the "
        "engine has work marks the node stalled: /ready and /health answer 503, its requests end with 503 and "
        "it exits to be restarted; keep it above the longest legitimate step.", unit="s"),
    Key("engine.pool_call_timeout_s", positive_float, 30.0, "How long a caller on the event loop waits for a call "
        "into the engine's block pool (a lease, a pull's blocks) to run between steps; a call that gives blocks "
        "back still runs after its caller gave up.", unit="s"),
    Key("engine.grammar_compile_timeout_s", positive_float, 5.0, "A constraint a node has not compiled before is "
        "compiled first in a child process killed after this; over it, the request is a 400 naming its field, and "
        "so is every repeat of it, at once.", unit="s"),
    # --------------------------------------------------------------- internal
    Key("internal.bind", string, "127.0.0.1", "The address the nodes' internal endpoints (KV metadata, events, "
        "prefill and decode APIs) listen on; one reachable from other machines needs a token."),
    Key("internal.token", string, None, "The shared secret nodes require as X-Kvrelay-Token on internal "
        "endpoints.", default_text=f"$token_env, else ${TOKEN_ENV}", secret=True),
    Key("internal.token_env", string, None, "The name of an environment variable holding internal.token, read "
        "when token is unset.", feeds="internal.token"),
    Key("internal.drain_timeout_s", positive_float, 30.0, "On SIGTERM, how long admitted requests may take to "
        "finish.", unit="s"),
    Key("internal.keepalive_timeout_s", positive_float, 75.0, "An idle HTTP connection to a node is closed after "
        "this by the node; its callers (router, decode nodes) close theirs after half of it, at most 15 s.",
        unit="s"),
    Key("internal.header_read_timeout_s", positive_float, 10.0, "A node's client (the router, a decode node) must "
        "send a request's line and headers within this from connecting, or from a kept-alive request's first "
        "byte; else 408 and the connection is closed.", unit="s"),
    Key("internal.max_open_connections", positive_int, None, "Open connections to one node; more are answered 503 "
        "at once and closed. At start a node raises its open-file soft limit to the hard one (ulimit -Hn).",
        unit="connections", default_text="half the open-file limit", also="<= the open-file limit - 128"),
    Key("internal.persist_timeout_s", positive_float, 300.0, "After the drain, the bound on writing the device "
        "and host tiers to disk (`kvrelay up` waits as long); raise it for host tiers over ~100 GiB.", unit="s"),
    # ---------------------------------------------------------------- prefill
    Key("prefill.ports", port_list, (), "One prefill node per port (its internal endpoints); empty: no prefill "
        "nodes, every prompt is computed on its decode node."),
    Key("prefill.lease_ttl_s", positive_float, 30.0, "How long a prefill node keeps a prompt's published KV "
        "blocks pinned for a decode node to pull.", unit="s"),
    Key("prefill.devices", device_list, (), _DEVICES, also="one entry per port, or none"),
    Key("prefill.max_pending_requests", positive_int, 256, "Requests waiting or running on a prefill node beyond "
        "which new ones get 429 (the router's queue keeps below it).", unit="requests"),
    Key("prefill.serve_whole_requests", boolean, False, "Also serve whole requests (prefill and decode here, no "
        "KV pull); under router.disaggregation auto the router places a request here when that breaches fewer "
        "SLOs, or costs less, than the decode node's plan (its decode included), or, before the nodes report "
        "rates, when it is less loaded than the decode nodes."),
    # ----------------------------------------------------------------- decode
    Key("decode.ports", port_list, (8200,), "One decode node per port (its internal endpoints).",
        also="at least one"),
    Key("decode.on_transfer_failure", one_of(FAILURE_POLICIES), "recompute", "When pulling a prompt's KV fails: "
        "compute the prompt on the decode node, or fail the request."),
    Key("decode.max_pending_requests", positive_int, 256, "Requests waiting or running on a decode node beyond "
        "which new ones get 429.", unit="requests"),
    Key("decode.transfer_timeout_s", positive_float, 10.0, "How long a decode node waits for a prompt's KV "
        "pull.", unit="s"),
    Key("decode.devices", device_list, (), _DEVICES, also="one entry per port, or none"),
    Key("decode.write_stall_timeout_s", positive_float, 60.0, "A router that takes no frame of a stream for this "
        "long is cut off and the request aborted, its blocks freed.", unit="s"),
    Key("decode.long_context.policy", one_of(POLICIES), _LC.policy, "none: full attention; h2o: evict the tokens "
        "with the least accumulated attention beyond the budget; infinigen: offload cold blocks to the host tier "
        "and recall them per layer.", also="infinigen needs a host tier"),
    Key("decode.long_context.device_budget_tokens", positive_int, _LC.device_budget_tokens, "The KV a sequence "
        "may keep on device (whole blocks count).", unit="tokens",
        also="< 2^31; holds the blocks the policy always keeps"),
    Key("decode.long_context.sink_tokens", non_negative_int, _LC.sink_tokens, "The first tokens, always kept on "
        "device (attention sinks).", unit="tokens", also=_BELOW_2_31),
    Key("decode.long_context.recent_tokens", non_negative_int, _LC.recent_tokens, "The last tokens, always kept "
        "on device.", unit="tokens", also=_BELOW_2_31),
    Key("decode.long_context.recall_blocks", non_negative_int, _LC.recall_blocks, "infinigen: the staging blocks "
        "of offloaded KV each layer attends to per step.", unit="blocks", also="< 2^31; >= 1 under infinigen"),
    Key("decode.long_context.selection", one_of(SELECTIONS), _LC.selection, "infinigen: recall the blocks whose "
        "key summaries score highest against the query (blocks), or the tokens a partial query one layer "
        "ahead predicts (speculative)."),
    Key("decode.long_context.speculation_alpha", finite_non_negative_float, _LC.speculation_alpha, "speculative: "
        "prefetch the offloaded tokens whose speculated logit is within this margin of the best one.",
        unit="logit"),
    Key("decode.long_context.partial_channels_frac", unit_fraction, _LC.partial_channels_frac, "speculative: the "
        "share of each head's channels in the partial key cache.", unit="fraction"),
    # ----------------------------------------------------------------- router
    Key("router.host", string, "127.0.0.1", "The address the OpenAI-compatible API listens on."),
    Key("router.port", port, 8000, "The API's port."),
    Key("router.api_keys", string_list, (), "Keys clients must send as a Bearer token; none here or in "
        "api_keys_env: no authentication.", secret=True),
    Key("router.api_keys_env", string, None, "The name of an environment variable holding more API keys, "
        "comma-separated.", feeds="router.api_keys"),
    Key("router.max_body_bytes", size, 1024 * 1024, "The largest request body accepted.", unit="bytes"),
    Key("router.request_timeout_s", positive_float, 300.0, "The longest a request may run once placed on "
        "nodes (its wait in the queue counts against router.queue_timeout_s instead).", unit="s"),
    Key("router.max_n", positive_int, 4, "The most choices (n) one request may ask for."),
    Key("router.load_weight_tokens", positive_int, 64, "Placement before the nodes report rates: the tokens one "
        "running request weighs against the prompt tokens a node already holds.", unit="tokens"),
    Key("router.prefill_urls", url_list, (), "The prefill nodes' URLs.",
        default_text="http://{internal.bind}:{port} per prefill port, without prefill_dns"),
    Key("router.decode_urls", url_list, (), "The decode nodes' URLs.",
        default_text="http://{internal.bind}:{port} per decode port, without decode_dns"),
    Key("router.max_concurrent_requests", positive_int, 16384, "Connections admitted at once (queued or "
        "running); more get 429.", unit="requests"),
    Key("router.max_connections_per_node", positive_int, 1024, "Pooled request connections to each node.",
        unit="connections"),
    Key("router.connect_timeout_s", positive_float, 5.0, "The TCP connect to a node (not the wait for a pooled "
        "connection).", unit="s"),
    Key("router.prefill_dns", dns_list, (), "host:port names whose every address is a prefill node (a k8s "
        "headless Service)."),
    Key("router.decode_dns", dns_list, (), "host:port names whose every address is a decode node."),
    Key("router.dns_interval_s", positive_float, 10.0, "How often the DNS names are resolved again.", unit="s"),
    Key("router.max_queued_requests", positive_int, 8192, "Generation requests waiting for room on the nodes; "
        "more get 429.", unit="requests"),
    Key("router.max_queued_bytes", size, 256 * 1024 * 1024, "The waiting requests' prompts as the router "
        "holds them (4 bytes a token, 73 a block key); more get 429.", unit="bytes"),
    Key("router.queue_timeout_s", positive_float, 300.0, "How long a request may wait for room; a longer "
        "predicted wait is a 429 at once.", unit="s"),
    Key("router.decode_reserve_tokens", positive_int, 256, "The most output tokens a decode node's room is "
        "reserved for, per request.", unit="tokens"),
    Key("router.migration_limit", non_negative_int, 3, "Times one request may move to another decode node "
        "mid-stream; 0: never."),
    Key("router.max_grammar_bytes", size, 32 * 1024, "The largest EBNF grammar (structured_outputs.grammar, "
        "guided_grammar) a request may carry; more is a 400 before any node compiles it.", unit="bytes"),
    Key("router.max_grammar_nesting", positive_int, 64, "The deepest nesting of parentheses in an EBNF grammar; "
        "deeper is a 400.", unit="levels"),
    Key("router.max_grammar_rules", positive_int, 500, "The most rules (::=) in an EBNF grammar; more is a 400.",
        unit="rules"),
    Key("router.max_grammar_alternatives", positive_int, 2000, "The most alternatives (|) in an EBNF grammar; more "
        "is a 400.", unit="alternatives"),
    Key("router.max_compiling_requests_per_tenant", positive_int, 16, "Requests of one API key whose constraint "
        "the router has not seen served (the nodes compile it first) that may run at once; more get 429.",
        unit="requests"),
    Key("router.compile_budget_s", positive_float, 30.0, "How long, within compile_budget_window_s, one API key "
        "may have a request with a new constraint between placement and first token (the nodes compile it "
        "there); past it, such requests get 429.", unit="s"),
    Key("router.compile_budget_window_s", positive_float, 60.0, "The sliding window of compile_budget_s.",
        unit="s"),
    Key("router.body_read_timeout_s", positive_float, 30.0, "A request body not in within this gets 408 (it holds "
        "no admission slot meanwhile).", unit="s"),
    Key("router.max_buffered_body_bytes", size, 256 * 1024 * 1024, "The bytes of request bodies the router reads or "
        "parses at once, all clients together; a body that would pass it gets 503.", unit="bytes"),
    Key("router.write_stall_timeout_s", positive_float, 30.0, "A client that takes no write of its answer for "
        "this long is dropped and its request ended.", unit="s"),
    Key("router.header_read_timeout_s", positive_float, 10.0, "A client must send a request's line and headers "
        "within this from connecting, or from a kept-alive request's first byte; else 408 and the connection is "
        "closed (Go's ReadHeaderTimeout).", unit="s"),
    Key("router.max_open_connections", positive_int, None, "Open client connections; more are answered 503 at once "
        "and closed, keeping the rest of the open-file limit (raised to the hard one at start) for connections to "
        "the nodes. max_concurrent_requests is lowered, with a warning, to what the rest can carry (two node "
        "connections per request).", unit="connections", default_text="half the open-file limit",
        also="<= the open-file limit - 128"),
    Key("router.keepalive_timeout_s", positive_float, 75.0, "An idle client connection is closed after this.",
        unit="s"),
    Key("router.disaggregation", one_of(DISAGGREGATION_MODES), "auto", "Where prompts are prefilled: always on a "
        "prefill node (when one is up), never (on the decode node), or auto: the plan predicted cheaper from the "
        "nodes' measured rates."),
    Key("router.tpot_slo_s", non_negative_float, 0.05, "Under auto, a prefill on a decode node must keep the "
        "streams decoding there within this time per output token; 0: not checked.", unit="s"),
    Key("router.ttft_slo_s", non_negative_float, 0.0, "Under auto, a plan whose predicted time to first token "
        "passes this counts as a breach; 0: none.", unit="s"),
    Key("router.tool_call_parser", one_of(PARSER_NAMES, message="is not a tool-call parser (--tool-call-parser): "
        f"use one of {', '.join(PARSER_NAMES)}"), None, "How the model writes tool calls (vLLM's "
        "--tool-call-parser).", default_text="the one the chat template or model family implies"),
    Key("router.reasoning_parser", one_of(ALL_REASONING_PARSERS, message="is not a reasoning parser "
        f"(--reasoning-parser): use one of {', '.join(ALL_REASONING_PARSERS)}"), None, "How a reasoning model's "
        "thinking is told from its answer in chat: message.reasoning_content and delta.reasoning_content carry "
        "the thinking, content the rest (vLLM's --reasoning-parser). A gpt_oss model is always served in the harmony "
        "format (openai_gptoss), whose analysis channel is the thinking.",
        default_text="none: all of it is content (gpt_oss: openai_gptoss)"),
    Key("router.chat_template", chat_template, None, "A chat template in place of the model's: the path of a Jinja "
        "file, or the template itself (vLLM's --chat-template); checked to compile when the config is read.",
        default_text="the model's (tokenizer_config.json or chat_template.jinja)"),
    Key("router.enable_auto_tool_choice", boolean, False, 'tool_choice "auto" (the default with tools) parses '
        "the output for tool calls (vLLM's --enable-auto-tool-choice)."),
    Key("router.return_tokens_as_token_ids", boolean, False, 'Logprobs name tokens "token_id:N" (vLLM\'s '
        "--return-tokens-as-token-ids)."),
    Key("router.generation_config", one_of(GENERATION_CONFIG_MODES), "auto", "Defaults of the sampling fields a "
        "request leaves out (vLLM's --generation-config): auto takes temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens and extra eos_token_id entries from the model's "
        "generation_config.json; vllm uses vLLM's neutral defaults."),
    # ---------------------------------------------------------- observability
    Key("observability.otlp_endpoint", http_url, None, "An OTLP/HTTP traces URL, e.g. "
        "http://collector:4318/v1/traces (vLLM's --otlp-traces-endpoint).",
        default_text="unset: no spans are recorded"),
)


def names_at(section: str) -> list[str]:
    """The key and subsection names directly under ``section`` ("" for the top level), in declaration order."""
    prefix = f"{section}." if section else ""
    names = (path[len(prefix):].split(".", 1)[0] for path in KEYS if path.startswith(prefix))
    return list(dict.fromkeys(names))
