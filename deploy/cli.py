"""The ``kvrelay`` command.

    kvrelay model pull NAME [--dir DIR] | kvrelay model list
    kvrelay tiny-model DIR [--seed S --layers N --hidden N --heads N --kv-heads N --vocab N --intermediate N
                            --weights-dtype float32|bfloat16|float16
                            --arch llama|qwen3|qwen3-moe|mixtral|gpt-oss|deepseek-v3]
    kvrelay generate --model DIR|ORG/NAME (--prompt TEXT | --prompt-ids 1,2,3) --max-tokens N
                     [--min-tokens N --ignore-eos --json --revision R --download-dir DIR --device auto|cpu|cuda]
    kvrelay serve DIR|ORG/NAME [vLLM's flags] | kvrelay up [--config FILE] | kvrelay router|prefill|decode ...
    kvrelay store stats|clear|verify --config FILE [--node NAME]
    kvrelay config show [--config FILE] | kvrelay config check FILE | kvrelay config reference [--out PATH]
    kvrelay bench memory|decode|cuda-graphs|hybrid-kv|kernel|kernel-plan|tiers|transfer|serve|goodput|long-context|load|
                  migration|disk-prefix|vllm-client|structured|guard|ttft-prefix|deterministic|edges
                  [...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# model.tiny.TINY_ARCHS (torch-free here)
TINY_ARCH_CHOICES = ("llama", "qwen3", "qwen3-moe", "mixtral", "gpt-oss", "deepseek-v3")

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # an agent name and a path component

# Before torch is imported: torch's CPU allocator then backs allocations of 2 MiB and more with
# transparent huge pages (madvise; this kernel's THP mode here is "madvise", so nothing gets them
# otherwise). Fewer TLB misses while streaming weights and KV: a 16-sequence decode step of the real
# model in bf16 measured 8-10% faster here (three A/B pairs). Every process of `kvrelay up` inherits it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from kvrelay.model.tiny import write_tiny_model

    out = write_tiny_model(
        args.dir, seed=args.seed, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, intermediate=args.intermediate, dtype=args.weights_dtype,
        arch=args.arch,
    )
    print(f"wrote tiny {args.arch} model to {out}")
    return 0


def _parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SystemExit(f"--prompt-ids: {text!r} is not a comma-separated list of integers, e.g. 1,2,3") from None


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvrelay.deploy.serve import use_triton_interpreter
    from kvrelay.model.device import resolve_device
    from kvrelay.model.hub import HubError, resolve_model

    try:
        model_dir = resolve_model(args.model, revision=args.revision, download_dir=args.download_dir).path
    except HubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        print(f"error: --device {args.device!r} {exc}", file=sys.stderr)
        return 2
    try:
        use_triton_interpreter(args.attention_backend, device)  # before the engine's imports load Triton
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams
    from kvrelay.model.tokenizer import load_tokenizer

    try:
        loaded = load_model(model_dir, dtype=args.dtype, device=device)
        tokenizer = load_tokenizer(model_dir)
    except (ValueError, OSError) as exc:
        print(f"error: {args.model}: {exc}", file=sys.stderr)
        return 2
    if args.prompt is not None:
        if tokenizer is None:
            print(f"error: {args.model} has no tokenizer.json; pass --prompt-ids instead", file=sys.stderr)
            return 2
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = _parse_prompt_ids(args.prompt_ids)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
        )
        engine = LLMEngine(loaded, EngineConfig(num_blocks=args.num_blocks, attention_backend=args.attention_backend,
                                                cuda_graphs=not args.enforce_eager))
        [[token_ids]] = engine.generate([prompt_ids], params)
    except (RequestError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = tokenizer.decode(token_ids) if tokenizer is not None else ""
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "attention_backend": engine.attention_backend,
                          "cuda_graph_batch_sizes": list(engine.cuda_graph_sizes)}))
    else:
        print(text if tokenizer is not None else " ".join(map(str, token_ids)))
    return 0


def _load(args: argparse.Namespace):  # noqa: ANN202 - returns deploy.config.Config
    """The config of ``--config`` with the flags over it, ``model.path`` resolved to a local directory
    (`deploy.model_source`: a hub repo id is fetched here).

    Raises:
        ConfigError: a bad value, or a repo id that cannot be resolved.
    """
    from kvrelay.deploy.config import load_config
    from kvrelay.deploy.model_source import resolve_config_model

    return resolve_config_model(load_config(args.config, model_path=args.model, router_port=getattr(args, "port", None),
                                            model_name=getattr(args, "served_model_name", None),
                                            router_host=getattr(args, "host", None)))


def _cmd_up(args: argparse.Namespace) -> int:
    from kvrelay.deploy.model_source import node_overrides
    from kvrelay.deploy.up import up

    config = _load(args)
    if not (Path(config.model.path) / "config.json").is_file():
        print(f"kvrelay up: model.path {config.model.path} is not a model directory (no config.json); "
              "`kvrelay model pull smollm2-135m-instruct --dir DIR` writes the real model there, "
              "`kvrelay tiny-model DIR` a small random one", file=sys.stderr)
        return 2
    overrides = (node_overrides(config) + (["--port", str(args.port)] if args.port else [])
                 + (["--host", args.host] if args.host else []))
    return up(config, args.config, overrides=overrides, lend_cpus=not args.no_cpu_lending)


def serve_config(args: argparse.Namespace, *, free_port: int) -> dict[str, Any]:
    """The YAML mapping `kvrelay serve` runs: ``--config`` (default: the local config) with the flags
    over it, one decode node on ``free_port`` (loopback; it computes the prompts itself) and no
    prefill node."""
    import yaml
    from kvrelay.deploy.config import DEFAULT_CONFIG

    data: dict[str, Any] = yaml.safe_load(Path(args.config or DEFAULT_CONFIG).read_text()) or {}

    def section(name: str) -> dict[str, Any]:
        value = data.get(name)
        data[name] = dict(value) if isinstance(value, dict) else {}
        return data[name]

    model, kv, engine, router = section("model"), section("kvstore"), section("engine"), section("router")
    model["path"] = args.model_dir
    for key, value in (("dtype", args.dtype), ("device", args.device), ("name", args.served_model_name),
                       ("revision", args.revision), ("download_dir", args.download_dir)):
        if value is not None:
            model[key] = value
    if args.block_size is not None:
        kv["block_size_tokens"] = args.block_size
    if args.gpu_memory_utilization is not None and args.kv_cache_memory is not None:
        raise SystemExit("kvrelay serve: give --gpu-memory-utilization or --kv-cache-memory, not both")
    if args.gpu_memory_utilization is not None:
        kv["device"] = {"gpu_memory_utilization": args.gpu_memory_utilization}
    if args.kv_cache_memory is not None:
        kv["device"] = {"bytes": args.kv_cache_memory}
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
                "attention_backend"):
        if getattr(args, key) is not None:
            engine[key] = getattr(args, key)
    if args.enforce_eager:
        engine["cuda_graphs"] = False
    for key in ("host", "port"):
        if getattr(args, key) is not None:
            router[key] = getattr(args, key)
    if args.api_key is not None:
        router["api_keys"] = [args.api_key]
    if args.tool_call_parser is not None:
        router["tool_call_parser"] = args.tool_call_parser
    if args.reasoning_parser is not None:
        router["reasoning_parser"] = args.reasoning_parser
    if args.chat_template is not None:
        router["chat_template"] = str(Path(args.chat_template).resolve()) if Path(args.chat_template).is_file() \
            else args.chat_template
    for key in ("enable_auto_tool_choice", "return_tokens_as_token_ids"):
        if getattr(args, key):
            router[key] = True
    if args.generation_config is not None:
        router["generation_config"] = args.generation_config
    if args.otlp_traces_endpoint is not None:
        section("observability")["otlp_endpoint"] = args.otlp_traces_endpoint
    for key in ("prefill_urls", "decode_urls", "prefill_dns", "decode_dns"):  # the one node is this machine's
        router.pop(key, None)
    section("prefill")["ports"] = []
    section("decode")["ports"] = [free_port]
    return data


def _cmd_serve(args: argparse.Namespace) -> int:
    import tempfile

    import yaml
    from kvrelay.deploy.config import load_config
    from kvrelay.deploy.model_source import node_overrides, resolve_config_model
    from kvrelay.deploy.ports import free_ports
    from kvrelay.deploy.sizes import ConfigError
    from kvrelay.deploy.up import up

    [free_port] = free_ports(1)  # the decode node's internal port: a free one on loopback
    data = serve_config(args, free_port=free_port)
    text = yaml.safe_dump(data, sort_keys=False)
    path = Path(tempfile.mkdtemp(prefix="kvrelay-serve-")) / "kvrelay.yaml"
    path.write_text(text)
    try:
        configured = load_config(path)
        config = resolve_config_model(configured)
    except ConfigError as exc:
        print(f"kvrelay serve: {exc}", file=sys.stderr)
        return 2
    if not (Path(config.model.path) / "config.json").is_file():
        print(f"kvrelay serve: {config.model.path} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    print("kvrelay serve: effective config (" + str(path) + "):\n" + text, flush=True)
    if config.model.path != configured.model.path:
        print(f"kvrelay serve: model {configured.model.path} is {config.model.path}", flush=True)
    return up(config, path, overrides=node_overrides(config), lend_cpus=False)


def _cmd_role(args: argparse.Namespace) -> int:
    from kvrelay.deploy.cpu_budget import parse_cpus
    from kvrelay.deploy.serve import run_role

    try:
        cpus = parse_cpus(args.cpus) if args.cpus else None
        pool = parse_cpus(args.cpu_pool) if args.cpu_pool else None
    except ValueError as exc:
        print(f"kvrelay {args.command}: {exc}", file=sys.stderr)
        return 2
    if (pool is None) != (args.cpu_lock_dir is None) or (pool is not None and cpus is None):
        print(f"kvrelay {args.command}: --cpu-pool and --cpu-lock-dir go together, with --cpus", file=sys.stderr)
        return 2
    if pool is not None and cpus is not None and not set(cpus) <= set(pool):
        print(f"kvrelay {args.command}: --cpus {args.cpus} is not inside --cpu-pool {args.cpu_pool}", file=sys.stderr)
        return 2
    from kvrelay.deploy.service_config import internal_token_problem

    config = _load(args)
    problem = internal_token_problem(config.internal)
    if problem is not None:
        print(f"kvrelay {args.command}: refusing to start: {problem}", file=sys.stderr)
        return 2
    from kvrelay.deploy.serve import edge_problem

    problem = edge_problem(config, args.command)
    if problem is not None:
        print(f"kvrelay {args.command}: refusing to start: {problem}", file=sys.stderr)
        return 2
    name = args.name or socket.gethostname()
    if not NODE_NAME.fullmatch(name):
        print(f"kvrelay {args.command}: --name {name!r} is not a node name (letters, digits, '.', '_', '-'; "
              "at most 63, starting with a letter or digit)", file=sys.stderr)
        return 2
    return run_role(config, args.command, args.index, name=name, cpus=cpus, cpu_pool=pool,
                    cpu_lock_dir=args.cpu_lock_dir, memory_budget_bytes=args.memory_budget)


BENCH_NAMES = ("bandwidth", "cache-policies", "cuda-graphs", "decode", "deterministic", "disk-prefix", "dtype",
               "edges", "goodput", "guard", "hybrid-kv", "install", "kernel", "kernel-plan", "load", "long-context",
               "memory", "migration", "mla", "prefill", "serve", "structured", "tiers", "tracing", "transfer",
               "ttft-prefix", "vllm-client")


def _bench_main(name: str) -> Callable[[list[str]], int]:
    """The ``main(argv)`` of benchmark ``name``, imported only when asked for (they pull in heavy
    libraries); explicit imports, so the dependency of this command on `benchmarks` is visible."""
    if name == "bandwidth":
        from kvrelay.benchmarks.bandwidth_bench import main
    elif name == "cache-policies":
        from kvrelay.benchmarks.cache_policies import main
    elif name == "cuda-graphs":
        from kvrelay.benchmarks.graph_bench import main
    elif name == "decode":
        from kvrelay.benchmarks.decode_bench import main
    elif name == "disk-prefix":
        from kvrelay.benchmarks.disk_prefix_bench import main
    elif name == "dtype":
        from kvrelay.benchmarks.dtype_bench import main
    elif name == "edges":
        from kvrelay.benchmarks.edges_bench import main
    elif name == "goodput":
        from kvrelay.benchmarks.goodput_bench import main
    elif name == "guard":
        from kvrelay.benchmarks.guard_bench import main
    elif name == "hybrid-kv":
        from kvrelay.benchmarks.hybrid_kv_bench import main
    elif name == "deterministic":
        from kvrelay.benchmarks.deterministic_bench import main
    elif name == "install":
        from kvrelay.benchmarks.install_time import main
    elif name == "kernel":
        from kvrelay.benchmarks.kernel_bench import main
    elif name == "kernel-plan":
        from kvrelay.benchmarks.kernel_plan_bench import main
    elif name == "load":
        from kvrelay.benchmarks.load import main
    elif name == "long-context":
        from kvrelay.benchmarks.long_context_bench import main
    elif name == "memory":
        from kvrelay.benchmarks.memory_bench import main
    elif name == "migration":
        from kvrelay.benchmarks.migration_bench import main
    elif name == "mla":
        from kvrelay.benchmarks.mla_bench import main
    elif name == "prefill":
        from kvrelay.benchmarks.prefill_bench import main
    elif name == "serve":
        from kvrelay.benchmarks.serve_bench import main
    elif name == "structured":
        from kvrelay.benchmarks.structured_bench import main
    elif name == "tiers":
        from kvrelay.benchmarks.tier_bench import main
    elif name == "tracing":
        from kvrelay.benchmarks.tracing_bench import main
    elif name == "transfer":
        from kvrelay.benchmarks.transfer_bench import main
    elif name == "ttft-prefix":
        from kvrelay.benchmarks.ttft_prefix import main
    elif name == "vllm-client":
        from kvrelay.benchmarks.vllm_client import main
    else:
        raise ValueError(f"unknown benchmark {name!r}; choose from {BENCH_NAMES}")
    return main


def _byte_size(text: str) -> int:
    from kvrelay.deploy.sizes import parse_size

    try:
        return parse_size(int(text) if text.isdigit() else text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None


def _cmd_bench(args: argparse.Namespace) -> int:
    return int(_bench_main(args.name)(args.rest))


def build_parser() -> argparse.ArgumentParser:
    from kvrelay.deploy.config_cmd import add_config_parser
    from kvrelay.deploy.model_cmd import add_model_parser
    from kvrelay.deploy.service_config import ATTENTION_BACKENDS
    from kvrelay.deploy.store_cmd import add_store_parser
    from kvrelay.model.dtype_names import DTYPE_CHOICES
    from kvrelay.model.generation_config import GENERATION_CONFIG_MODES
    from kvrelay.router.harmony import ALL_REASONING_PARSERS
    from kvrelay.router.tool_calls import PARSER_NAMES

    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="write a small deterministic random-weight model (HF format)")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=258)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    p.add_argument("--weights-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--arch", default="llama", choices=TINY_ARCH_CHOICES, help="model family (default: llama)")
    p.set_defaults(func=_cmd_tiny_model)

    p = sub.add_parser("generate", help="generate in one process (no network but a hub download of --model)")
    p.add_argument("--model", required=True, help="a Hugging Face model directory, or a hub repo id ORG/NAME")
    p.add_argument("--revision", default=None, help="of a hub repo id: the branch, tag or commit (default: main)")
    p.add_argument("--download-dir", default=None, help="of a hub repo id: the hub cache (default: huggingface_hub's)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    group.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop token is picked before this many")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: bfloat16 on CUDA and on CPUs with AMX / AVX512-BF16, else float32")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is a GPU, else the CPU), cpu, cuda, cuda:N")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                   help="default: triton on CUDA, torch on CPU (triton on CPU runs under Triton's interpreter)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every decode step runs eagerly")
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')
    p.set_defaults(func=_cmd_generate)

    from kvrelay.deploy.config import DEFAULT_CONFIG

    p = sub.add_parser("up", help="router + prefill + decode nodes from one YAML file, on this machine")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--model", default=None, help="override model.path (a directory, or a hub repo id ORG/NAME)")
    p.add_argument("--port", type=int, default=None, help="override router.port")
    p.add_argument("--host", default=None, help="override router.host: the address the API listens on (0.0.0.0: "
                                                "every interface, as in a container)")
    p.add_argument("--no-cpu-lending", action="store_true",
                   help="keep each node on its own CPUs even while it has nothing to compute")
    p.set_defaults(func=_cmd_up)
    p = sub.add_parser("serve", help="one engine node and the router on this machine, with vLLM's flag names "
                                     "(flags override --config)")
    p.add_argument("model_dir", metavar="MODEL",
                   help="a Hugging Face model directory, or a hub repo id ORG/NAME (fetched into the hub cache)")
    p.add_argument("--revision", default=None, help="model.revision: of a hub repo id, the branch, tag or commit")
    p.add_argument("--download-dir", default=None, help="model.download_dir: the hub cache (default: HF_HOME's)")
    p.add_argument("--config", type=Path, default=None, help="base YAML (default: deploy/configs/local.yaml)")
    p.add_argument("--host", default=None, help="router.host")
    p.add_argument("--port", type=int, default=None, help="router.port")
    p.add_argument("--served-model-name", default=None, help="model.name: what clients pass as model")
    p.add_argument("--api-key", default=None, help="router.api_keys: the one key clients must send")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, help="model.dtype")
    p.add_argument("--device", default=None, help="model.device: auto (the default: CUDA when there is a GPU, else "
                                                   "the CPU), cpu, cuda or cuda:N")
    p.add_argument("--block-size", type=int, default=None, help="kvstore.block_size_tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="kvstore.device.gpu_memory_utilization: as vLLM's, the share of the GPU's total memory for "
                        "the whole node (weights, activations, KV); ignored on CPU (the node says so)")
    p.add_argument("--kv-cache-memory", default=None, help='kvstore.device.bytes, e.g. "4GiB"')
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine.max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine.max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="engine.max_model_len")
    p.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS, help="engine.attention_backend")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="engine.enable_prefix_caching")
    p.add_argument("--enforce-eager", action="store_true",
                   help="engine.cuda_graphs: false (no CUDA graphs; every decode step runs eagerly)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='router.enable_auto_tool_choice: tool_choice "auto" (the default with tools) parses the '
                        "output for tool calls")
    p.add_argument("--tool-call-parser", default=None, choices=PARSER_NAMES,
                   help="router.tool_call_parser: how tool calls are written (default: the one the model's chat "
                        "template or family implies)")
    p.add_argument("--chat-template", default=None,
                   help="router.chat_template: a Jinja file, or the template itself, in place of the model's")
    p.add_argument("--reasoning-parser", default=None, choices=ALL_REASONING_PARSERS,
                   help="router.reasoning_parser: chat answers carry the model's thinking in reasoning_content, "
                        "apart from content")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="observability.otlp_endpoint: export one trace per request over OTLP/HTTP to this URL")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='router.return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"')
    p.add_argument("--generation-config", default=None, choices=GENERATION_CONFIG_MODES,
                   help="router.generation_config: auto (default) takes the sampling defaults of the model's "
                        "generation_config.json; vllm uses vLLM's neutral defaults")
    p.set_defaults(func=_cmd_serve)
    for role in ("router", "prefill", "decode"):
        p = sub.add_parser(role, help=f"run one {role} process (for separate deployments)")
        p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
        p.add_argument("--index", type=int, default=0, help=f"which of the configured {role} ports to serve")
        p.add_argument("--name", default=None,
                       help="this node's identity: its NIXL agent name, disk tier subdirectory and log prefix; "
                            "unique per deployment (default: the host name, so a StatefulSet pod is itself)")
        p.add_argument("--model", default=None, help="override model.path (a directory, or a hub repo id ORG/NAME)")
        p.add_argument("--served-model-name", default=None, help="override model.name")
        p.add_argument("--port", type=int, default=None, help="override router.port")
        p.add_argument("--host", default=None, help="override router.host")
        p.add_argument("--cpus", default=None, help="CPUs this node may use, e.g. 0-3 (default: all it may run on)")
        p.add_argument("--cpu-pool", default=None,
                       help="with --cpu-lock-dir: CPUs shared with other nodes of this machine; this node borrows "
                            "those whose owner is idle and lends its --cpus while idle (what `kvrelay up` passes)")
        p.add_argument("--cpu-lock-dir", default=None, help="directory of the CPU lock files of --cpu-pool")
        p.add_argument("--memory-budget", type=_byte_size, default=None,
                       help="bytes of host memory this node's fraction_of_free tiers are a share of (what `kvrelay "
                            "up` passes: its share of the memory free at the deployment's start); default: what "
                            "is free when the node starts")
        p.set_defaults(func=_cmd_role)

    p = sub.add_parser("bench", help="benchmarks; JSON to stdout (see `kvrelay bench NAME --help`)")
    p.add_argument("name", choices=BENCH_NAMES)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)

    add_store_parser(sub)
    add_model_parser(sub)
    add_config_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvrelay.deploy.sizes import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvrelay: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
