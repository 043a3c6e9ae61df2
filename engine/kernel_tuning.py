"""Timing the CPU kernel paths on the machine that runs them, and keeping the result per CPU model.

`plan_for` gives an engine its `model.kernel_plan.KernelPlan`:

* ``auto`` (the default): the plan stored for this key, else measured now and stored (unless the measuring
  thread was preempted for more than a tenth of the time: then it is used, not kept). The key (`plan_key`) is the
  CPU (`model.cpu_identity.CpuIdentity.kernel_label`: model name, family, model and the flags the kernels branch on),
  torch's version and thread count, the C++ kernels' sources, and the model's shapes and dtypes: a cache moved to
  another CPU model, a new build or another model measures again. Processes starting at once measure once: the
  first takes a file lock, the rest wait for it and read its plan (so two nodes of one deployment take the same
  paths).
* ``measure``: measured now, stored over the old plan.
* ``builtin``: the fixed rule (`model.kernel_plan.builtin_plan`), nothing timed.

`measure` times, in this order, each alternative at every row bucket with the candidates alternated round by round
and the best of each kept (the VM this was written on moved its memory speed from minute to minute, so one timing of
each would compare two speeds of the machine, not two kernels):

1. each kind of dense linear layer (`model.kernel_plan.LINEAR_KINDS`) on each path its weights have, over the
   layers a step reads one after the other (as many as stream ``STREAM_BYTES`` of weights at 1-16 rows, where a
   step is bound by memory; ``MANY_ROWS_LAYERS`` at 64 rows, where it is bound by compute);
2. prefill attention (512 tokens) and decode attention (16 rows of 128 tokens): the C++ kernels against torch's;
3. a decode-only step of each few-row bucket as the one C++ call against the per-layer path with the choices of
   1 and 2, both over a private KV pool of 128 tokens a sequence.

SmolLM2-135M bf16 on a 2-vCPU Zen 4 VM measures in a few seconds, once per machine; a tiny test model in well under
one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kvrelay.kernels.cpu_build import CPU_KERNELS, CSRC
from kvrelay.model.attention import AttentionBackend, AttentionBatch, TorchBackend
from kvrelay.model.cpu_identity import this_cpu
from kvrelay.model.kernel_paths import linear_kernels
from kvrelay.model.kernel_plan import (
    FEW_ROW_BUCKETS,
    LINEAR_KINDS,
    ROW_BUCKETS,
    KernelPlan,
    builtin_plan,
    deterministic_plan,
)
from kvrelay.model.linear_kernel import LinearKernel
from kvrelay.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm

log = logging.getLogger(__name__)

PLAN_MODES = ("auto", "measure", "builtin")
STREAM_BYTES = 256 << 20  # weights a few-row timing streams: well past any L3 here, a few ms at 50 GB/s
MANY_ROWS_LAYERS = 4  # layers a 64-row timing multiplies: compute-bound, so a few say as much as all
ROUNDS_FEW, ROUNDS_MANY = 7, 3  # rounds of alternated candidates; the median of each is compared
CONTEXT_BLOCKS = 8  # KV blocks a timed decode sequence holds (128 tokens at 16 a block)
PREFILL_TOKENS = 512
MIN_CPU_SHARE = 0.9  # a plan is kept only if the measuring thread ran this share of the wall time (not preempted)


def default_cache_dir() -> Path:
    """``~/.cache/kvrelay/kernel-plans``."""
    return Path.home() / ".cache" / "kvrelay" / "kernel-plans"


def plan_key(model: torch.nn.Module, kv_pool: torch.Tensor, *, cpu: str) -> str:
    """A digest of what a plan depends on (see module doc)."""
    cfg = model.config
    digest = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    weight = model.model.embed_tokens.weight
    # the variant loaded: a wheel without this CPU's best one runs another, whose timings differ
    facts = {"cpu": cpu, "variant": CPU_KERNELS.variant if CPU_KERNELS.load() is not None else "none",
             "torch": torch.__version__, "threads": torch.get_num_threads(),
             "kernels": digest.hexdigest(), "dtype": str(weight.dtype), "kv": [str(kv_pool.dtype), *kv_pool.shape[1:]],
             "shape": [cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                       cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size]}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def plan_for(model: torch.nn.Module, kv_pool: torch.Tensor, backend: AttentionBackend, *, mode: str = "auto",
             cache_dir: Path | None = None) -> KernelPlan:
    """The plan for ``model`` stepping over a pool like ``kv_pool`` with ``backend`` (see module doc). A model that
    is not on the CPU, has no dense linear kernels, or whose plan cannot be timed gets `builtin_plan`.

    Raises:
        ValueError: ``mode`` is not one of `PLAN_MODES`.
    """
    if mode not in PLAN_MODES:
        raise ValueError(f"kernel_plan must be one of {', '.join(PLAN_MODES)}; got {mode!r}")
    kinds = linear_kernels(model) if isinstance(model, LlamaForCausalLM) else {}
    packed = any(k.packed is not None for kernels in kinds.values() for k in kernels)
    if (mode == "builtin" or kv_pool.device.type != "cpu" or not isinstance(backend, TorchBackend)
            or not all(kinds.get(kind) for kind in LINEAR_KINDS)):
        return builtin_plan(packed=packed)
    cpu = this_cpu().kernel_label
    directory = cache_dir or default_cache_dir()
    key = plan_key(model, kv_pool, cpu=cpu)
    path = directory / f"{key}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / f"{key}.lock", "w")  # noqa: SIM115 - held until the plan is stored
    except OSError as exc:
        log.warning("kernel plan: cannot use %s (%s); measuring without keeping the plan", directory, exc)
        return measure(model, kv_pool, backend, cpu=cpu)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if mode == "auto" and path.exists():
            try:
                return KernelPlan.from_json(path.read_text())
            except (OSError, ValueError) as exc:
                log.warning("kernel plan: %s unreadable (%s); measuring again", path, exc)
        started_cpu, started = time.thread_time(), time.perf_counter()
        plan = measure(model, kv_pool, backend, cpu=cpu)
        share = (time.thread_time() - started_cpu) / (time.perf_counter() - started)
        if share < MIN_CPU_SHARE:  # preempted for a good part of it: good for this process, not to keep
            log.warning("kernel plan: this thread ran %.0f%% of the time it was measured (another process shares "
                        "its CPUs); using the plan without keeping it, the next start measures again", 100 * share)
            return plan
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(plan.to_json())
        staged.replace(path)  # whole or not at all: a reader never sees half a plan
        return plan


def deterministic_plan_for(model: torch.nn.Module, kv_pool: torch.Tensor, backend: AttentionBackend) -> KernelPlan:
    """`model.kernel_plan.deterministic_plan`, after checking that every kernel of ``model``'s steps then has a
    batch-invariant path: a dense decoder (`model.llama` GQA attention and MLP) on the CPU backend with the C++
    kernels built, bf16 or float32 weights (blocked copies) and KV of the weights' dtype.

    Raises:
        ValueError: naming what deterministic mode does not cover here.
    """
    def refuse(why: str) -> ValueError:
        return ValueError(f"engine.deterministic: {why}; deterministic mode covers dense bf16 or float32 models on "
                          "the CPU with the C++ kernels")

    if not isinstance(model, LlamaForCausalLM):
        raise refuse(f"{type(model).__name__} is not a decoder this mode knows")
    if kv_pool.device.type != "cpu" or not isinstance(backend, TorchBackend):
        raise refuse(f"the KV pool is on {kv_pool.device.type} with the {type(backend).__name__}")
    if backend.cpu_decode_kernels is None:
        raise refuse("the C++ CPU kernels are off or did not build (KVRELAY_CPU_KERNELS=0, or no compiler)")
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.self_attn, Attention):
            raise refuse(f"layer {i}'s attention is {type(layer.self_attn).__name__}, not GQA (latent attention is not "
                         "covered)")
        if not isinstance(layer.ffn, MLP):
            raise refuse(f"layer {i}'s feed-forward is {type(layer.ffn).__name__}, not a dense MLP (mixtures of "
                         "experts are not covered)")
    weight = model.model.embed_tokens.weight
    if kv_pool.dtype != weight.dtype:
        raise refuse(f"the KV is {kv_pool.dtype} and the weights {weight.dtype}")
    for kind, kernels in linear_kernels(model).items():
        if not kernels or not all(k.can_take("blocked") for k in kernels):
            raise refuse(f"the {kind} weights ({weight.dtype}) have no blocked copy")
    if not all(m.fast is not None for m in model.modules() if isinstance(m, RMSNorm)):
        raise refuse("an RMSNorm has no C++ kernel (weights scaled in float32, or not contiguous)")
    return deterministic_plan(stack=model.decode_stack is not None)


def best_us(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each candidate's best time in microseconds over ``rounds`` rounds, after one warm-up call each; within a
    round they run one after the other, the order turned each round. The best, not the median: a run the scheduler
    preempts takes a whole time slice longer (seen: timings in steps of ~8 ms beside another busy process), and
    one clean run of each is enough to compare them."""
    names = list(candidates)
    for name in names:
        candidates[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            candidates[name]()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {n: min(t) for n, t in times.items()}


def fastest(timings: dict[str, float]) -> str:
    """The name with the smallest time (the first listed of equal ones)."""
    return min(timings, key=timings.__getitem__)


def measure(model: torch.nn.Module, kv_pool: torch.Tensor, backend: TorchBackend, *, cpu: str) -> KernelPlan:
    """Time every candidate (module doc) and return the plan of the fastest, ``source="measured"``. Leaves the
    model's kernels on the measured paths and ``backend`` following the plan; frees nothing
    (`model.kernel_paths.apply_kernel_plan` does)."""
    start = time.perf_counter()
    timings: dict[str, float] = {}
    kinds = linear_kernels(model)
    linear = _measure_linear(kinds, timings)
    attention = _measure_attention(model, kv_pool, backend, timings)
    for kind, kernels in kinds.items():  # the per-layer path the stack is timed against takes the choices so far
        for kernel in kernels:
            kernel.use(linear[kind])
    backend.cpp_prefill, backend.cpp_decode = attention[0] == "cpp", attention[1] == "cpp"
    stack = _measure_stack(model, kv_pool, backend, timings)
    plan = KernelPlan(linear=linear, stack=stack, prefill_attention=attention[0], decode_attention=attention[1],
                      source="measured", cpu=cpu, timings_us={k: round(v, 1) for k, v in timings.items()})
    log.info("kernel plan measured in %.1f s on %s: %s", time.perf_counter() - start, cpu, plan.summary())
    return plan


def _measure_linear(kinds: dict[str, list[LinearKernel]], timings: dict[str, float]) -> dict[str, tuple[str, ...]]:
    """Each kind's fastest path per row bucket (module doc, 1); records every timing in ``timings``."""
    out: dict[str, tuple[str, ...]] = {}
    for kind, kernels in kinds.items():
        weight = kernels[0].weight
        per_layer = weight.numel() * weight.element_size()
        paths: list[str] = []
        for bucket, rows in enumerate(ROW_BUCKETS):
            many = bucket >= FEW_ROW_BUCKETS
            count = MANY_ROWS_LAYERS if many else max(1, STREAM_BYTES // per_layer)
            timed = kernels[:count]
            x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
            names = [p for p in (("onednn", "torch") if many else ("blocked", "onednn", "torch"))
                     if all(k.can_take(p) for k in timed)]
            candidates = {p: _linear_pass(timed, p, x) for p in names}
            result = best_us(candidates, ROUNDS_MANY if many else ROUNDS_FEW)
            timings.update({f"linear.{kind}.{rows}.{p}": t for p, t in result.items()})
            paths.append(fastest(result))
        out[kind] = tuple(paths)
    return out


def _linear_pass(kernels: list[LinearKernel], path: str, x: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        with torch.inference_mode():
            for kernel in kernels:
                kernel.run(path, x)
    return run


def _measure_attention(model: torch.nn.Module, kv_pool: torch.Tensor, backend: TorchBackend,
                       timings: dict[str, float]) -> tuple[str, str]:
    """(prefill, decode) attention path (module doc, 2): ``cpp`` or ``torch``; ``cpp`` untimed where the model's
    KV is not plain K and V planes or the C++ kernels are missing (nothing to choose)."""
    cfg = model.config
    if backend.cpu_decode_kernels is None or cfg.mla is not None or kv_pool.shape[2] != 2:
        return "cpp", "cpp"
    block = kv_pool.shape[4]
    heads, dim = cfg.num_attention_heads, kv_pool.shape[5]
    dtype = kv_pool.dtype
    chosen = []
    for name, rows, context in (("prefill_attention", PREFILL_TOKENS, PREFILL_TOKENS),
                                ("decode_attention", ROW_BUCKETS[FEW_ROW_BUCKETS - 1], CONTEXT_BLOCKS * block)):
        prefill = name == "prefill_attention"
        seqs = 1 if prefill else rows
        per_seq = -(-context // block)
        pool = torch.zeros((seqs * per_seq + 1, *kv_pool.shape[3:]), dtype=dtype)
        k_cache, v_cache = pool, torch.zeros_like(pool)
        tables = (torch.arange(seqs * per_seq, dtype=torch.int32) + 1).reshape(seqs, per_seq)
        q = torch.randn(rows, heads, dim).to(dtype)
        lens = torch.full((seqs,), context, dtype=torch.int32)
        scale = dim ** -0.5

        def run(cpp: bool, prefill: bool = prefill, q: torch.Tensor = q, k: torch.Tensor = k_cache,
                v: torch.Tensor = v_cache, tables: torch.Tensor = tables, lens: torch.Tensor = lens,
                scale: float = scale) -> None:
            backend.cpp_prefill = backend.cpp_decode = cpp
            with torch.inference_mode():
                if prefill:
                    backend.prefill_attention(q, k, v, tables, lens, torch.tensor([0, len(q)], dtype=torch.int32),
                                              scale=scale)
                else:
                    backend.paged_decode_attention(q, k, v, tables, lens, scale=scale)

        result = best_us({"cpp": lambda run=run: run(True), "torch": lambda run=run: run(False)}, ROUNDS_FEW)
        timings.update({f"{name}.{p}": t for p, t in result.items()})
        chosen.append(fastest(result))
    backend.cpp_prefill = backend.cpp_decode = True
    return chosen[0], chosen[1]


def _measure_stack(model: torch.nn.Module, kv_pool: torch.Tensor, backend: TorchBackend,
                   timings: dict[str, float]) -> tuple[bool, ...]:
    """Per few-row bucket, whether the one-call C++ decode step beat the per-layer path (module doc, 3); all False
    where the model has no fused layers or the C++ kernels cannot take its steps."""
    weight = model.model.embed_tokens.weight
    fuses = model.decode_stack is not None or any(layer.fused is not None for layer in model.model.layers)
    if not fuses or not model.fuses_on(weight.dtype, weight.device, kv_pool, backend):
        return (False,) * FEW_ROW_BUCKETS
    block, groups = kv_pool.shape[4], len(model.config.kv_groups)
    saved = model.stack_by_bucket
    chosen = []
    try:
        for rows in ROW_BUCKETS[:FEW_ROW_BUCKETS]:
            pool = torch.zeros((rows * CONTEXT_BLOCKS + 1, *kv_pool.shape[1:]), dtype=kv_pool.dtype)
            tables = [[1 + r * CONTEXT_BLOCKS + b for b in range(CONTEXT_BLOCKS)] for r in range(rows)]
            position = CONTEXT_BLOCKS * block - 1  # each sequence's last token: its KV fills the table
            slots = [t[-1] * block + block - 1 for t in tables]
            ids, positions, lens = [1] * rows, [position] * rows, [position + 1] * rows
            batch = _decode_batch(tables, slots, lens, groups)

            def fused(rows: int = rows, pool: torch.Tensor = pool, tables: list = tables, slots: list = slots,
                      ids: list = ids, positions: list = positions, lens: list = lens, batch: AttentionBatch = batch,
                      ) -> None:
                model.stack_by_bucket = (True,) * FEW_ROW_BUCKETS
                if model.fuses_decode_logits(rows, pool, backend):
                    model.decode_logits(ids, positions, pool, [slots] * groups, [tables] * groups, lens)
                else:
                    _forward_logits(model, ids, positions, pool, batch, backend)

            def layers(pool: torch.Tensor = pool, ids: list = ids, positions: list = positions,
                       batch: AttentionBatch = batch) -> None:
                model.stack_by_bucket = (False,) * FEW_ROW_BUCKETS
                _forward_logits(model, ids, positions, pool, batch, backend)

            result = best_us({"stack": fused, "layers": layers}, ROUNDS_FEW)
            timings.update({f"stack.{rows}.{p}": t for p, t in result.items()})
            chosen.append(fastest(result) == "stack")
    finally:
        model.stack_by_bucket = saved
    return tuple(chosen)


def _decode_batch(tables: list[list[int]], slots: list[int], lens: list[int], groups: int) -> AttentionBatch:
    """The `AttentionBatch` of a decode-only step: every KV block group on the same tables (timing only)."""
    empty = torch.zeros(0, dtype=torch.int32)
    batch = AttentionBatch(slot_mapping=torch.tensor(slots, dtype=torch.int64), num_prefill_tokens=0,
                           prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32), prefill_seq_lens=empty,
                           prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
                           decode_block_tables=torch.tensor(tables, dtype=torch.int32),
                           decode_seq_lens=torch.tensor(lens, dtype=torch.int32))
    return batch if groups == 1 else dataclasses.replace(batch, group_batches=(batch,) * groups)


def _forward_logits(model: torch.nn.Module, ids: list[int], positions: list[int], pool: torch.Tensor,
                    batch: AttentionBatch, backend: TorchBackend) -> None:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), pool, batch, backend)
        model.compute_logits(hidden)
