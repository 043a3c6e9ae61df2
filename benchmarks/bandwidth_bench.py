"""``kvrelay bench bandwidth``: batch-1 decode speed against the memory-bandwidth limit, in one run.

Decoding one sequence reads every weight once per token, so no engine can beat

    limit (tokens/s) = read bandwidth (bytes/s) / weight bytes per token

where the read bandwidth is measured here, now, as bytes read per second by a float32 ``Tensor.sum`` over a
buffer far larger than the caches, and the weight bytes are every parameter once (a tied embedding counts once: the
head reads all of it, the lookup one row). The engine runs in process on the real model (``--dtype auto``: bf16
here), one greedy sequence, with the same torch thread count.

This VM's memory moves between ~30 and ~65 GB/s from minute to minute, and at times within a second, so the
headline pairs each decode step with the bandwidth of the same moment: before every engine step after the first
token, a ``sum`` over a buffer of the weights' size (on huge pages, as the weights are) is timed, and

    fraction_of_limit = median over the steps of (that read's time / the step's time)

(each step against the read just before it; the decode rate is one over the median step). Each round also keeps
the earlier figure, ``fraction_of_peak_limit``: the decode rate against the higher of two best-of-3 reads of a
1 GiB buffer, just before and just after the decode (a peak the decode may not have seen: a phase change within the
round lowers it). The copy bandwidth (``Tensor.copy_``, bytes read plus bytes written) is reported beside them.
Until stop 43 the limit was the copy's bytes copied per second, which counts half of the traffic a copy makes.
The round of median fraction is reported (every round is in ``rounds``).

Where the VM places its two vCPUs moves with the phases. Each round records, before and after its decode, the time
for a cache line to go from one thread of the two-thread team to the other and back
(`kvrelay_cpu.thread_round_trip_ns`) and the read bandwidth of one thread alone. On the 2-vCPU Zen 4 VM of stops
57-62 the slow phase is two vCPUs behind one cache (61-75 ns; two threads read ~1.1x one thread, ~34 GB/s) and
the fast phase two vCPUs on different dies (304-338 ns; two threads read ~2x one thread, ~60 GB/s): the limit halves
while every hand-off between a decode step's two threads (~300 a step) pays the longer trip. Rounds are
classed ``near`` (both trips under 150 ns), ``far`` (both over) or ``changed``, and ``fraction_of_limit_by_placement``
gives each class's median.

    kvrelay bench bandwidth --model .models/smollm2-135m-instruct

``--compare one-call|balance`` instead alternates one change's old and new path step by step in each round, each step
paired with a read as above (`compare_rounds`): the A/B behind stop 59's figures, in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from kvrelay.benchmarks.common import emit, machine_label

COPY_BYTES = 1 << 30


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes read plus bytes written per second (best of ``repeats``) copying one ``nbytes`` buffer to another,
    first touch excluded."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes read per second (best of ``repeats``) by a float32 sum over an ``nbytes`` buffer, first touch
    excluded: what reading every weight once per token can reach at most. The buffer lies on transparent huge
    pages where the kernel grants them (`kernels.cpu_small.huge_page_buffer`), as the engine's decode weights do
    (`model.linear_kernel.colocate_blocked`): on 4 KiB pages the same sum reads ~10% less on a Zen 4 VM, which
    would flatter the fraction."""
    from kvrelay.kernels.cpu_small import huge_page_buffer

    src = huge_page_buffer(nbytes // 4 * 4)[0].view(torch.float32)
    src.fill_(1.0)
    return sum_rate(src, repeats)


def sum_rate(buf: torch.Tensor, repeats: int) -> float:
    """Bytes read per second (best of ``repeats``) by ``buf.sum()`` on the current torch threads."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / best


NEAR_ROUND_TRIP_NS = 150.0  # below: the two threads share a cache (61-75 ns measured); above: apart (304-338 ns)


def one_thread_read(buf: torch.Tensor, repeats: int = 3) -> float:
    """Bytes read per second (best of ``repeats``) by a float32 sum over ``buf`` on one torch thread; the thread
    count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sum_rate(buf, repeats)
    finally:
        torch.set_num_threads(threads)


def round_trip_ns(trips: int = 1000, probes: int = 5) -> float | None:
    """The median of ``probes`` runs of `kvrelay_cpu.thread_round_trip_ns` over ``trips`` round trips each (one run
    that met a descheduled vCPU reads µs), or None where it cannot run: no compiled extension, or fewer than two
    CPUs to run on (the two threads would then take turns on one)."""
    from kvrelay.kernels.cpu_small import load

    ext = load()
    if ext is None or len(os.sched_getaffinity(0)) < 2 or torch.get_num_threads() < 2:
        return None
    ns = statistics.median(ext.thread_round_trip_ns(trips) for _ in range(probes))
    return None if ns != ns else ns  # NaN: the team had one thread


def placement(before_ns: float | None, after_ns: float | None) -> str | None:
    """``near``, ``far`` or ``changed`` from a round's two round trips (`NEAR_ROUND_TRIP_NS`); None without them."""
    if before_ns is None or after_ns is None:
        return None
    near = (before_ns < NEAR_ROUND_TRIP_NS, after_ns < NEAR_ROUND_TRIP_NS)
    return "near" if all(near) else "far" if not any(near) else "changed"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (tied tensors once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _setup(model_dir: str, dtype: str, prompt_tokens: int) -> tuple[Any, Any, list[int], int, torch.Tensor]:
    """The loaded model, an engine over it, a prompt of ``prompt_tokens`` ids, the weights' bytes and a buffer of
    that size on huge pages (float32 ones) to read before each step."""
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.kernels.cpu_small import huge_page_buffer
    from kvrelay.model.loader import load_model

    loaded = load_model(model_dir, dtype=dtype)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=256, enable_prefix_caching=False))
    span = min(30000, loaded.model.config.vocab_size - 100)  # ids 100 .. 30099 where the vocabulary has them
    prompt = [(i * 7919) % span + 100 for i in range(prompt_tokens)]
    nbytes = weight_bytes(loaded.model)
    paired = huge_page_buffer(max(4, nbytes // 4 * 4))[0].view(torch.float32)
    paired.fill_(1.0)
    return loaded, engine, prompt, nbytes, paired


COMPARISONS = ("one-call", "balance")


def compare_rounds(model_dir: str, *, dtype: str, prompt_tokens: int, new_tokens: int, rounds: int,
                   compare: str) -> dict[str, Any]:
    """The old and new path of one change alternated step by step in each round's decode (the round's first step
    alternating between them), each step after the first token paired with a read of the weights' size as in
    `decode_rounds`:

    * ``one-call``: `LlamaForCausalLM.decode_logits` (the embedding, layers, final norm, head and greedy token in one
      C++ call) against `forward` then `compute_logits` and the sampler's own argmax;
    * ``balance``: the decode stack's team of two at its learnt cuts against equal halves (``DecodeStack.set_cuts``;
      an equal-halves step's measurements are dropped).

    Returns per round the median step of each, new/old, and each one's median paired fraction; and the median of
    the rounds' new/old.

    Raises:
        ValueError: an unknown ``compare``, ``new_tokens`` below 3, or a model without the one-call decode.
    """
    from kvrelay.model.sampling import SamplingParams

    if compare not in COMPARISONS:
        raise ValueError(f"compare must be one of {', '.join(COMPARISONS)}, got {compare!r}")
    if new_tokens < 3:
        raise ValueError(f"new_tokens must be at least 3 (a step of each path), got {new_tokens}")
    loaded, engine, prompt, nbytes, paired = _setup(model_dir, dtype, prompt_tokens)
    model = loaded.model
    if not model.stack_logits:
        raise ValueError("this model has no one-call decode (a fused decode stack: bf16 or float32 on the CPU)")
    stack = model.decode_stack
    per_round = []
    for r in range(rounds):
        times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
        engine.add_request(f"c{r}", prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        engine.step()  # the prompt
        step = 0
        while engine.has_unfinished():
            name = ("old", "new")[(step + r) % 2]
            step += 1
            learnt = stack.cuts()
            if compare == "one-call":
                model.stack_logits = name == "new"
            elif name == "old":
                stack.set_cuts([500] * len(learnt))
            t0 = time.perf_counter()
            paired.sum()
            t1 = time.perf_counter()
            engine.step()
            times[name].append((t1 - t0, time.perf_counter() - t1))
            if compare == "balance" and name == "old":
                stack.set_cuts(learnt)
        model.stack_logits = True
        md = statistics.median
        old, new = (md(s for _, s in times[k]) for k in ("old", "new"))
        per_round.append({"step_ms_old": 1e3 * old, "step_ms_new": 1e3 * new, "new_over_old": new / old,
                          "fraction_old": md(rd / s for rd, s in times["old"]),
                          "fraction_new": md(rd / s for rd, s in times["new"]),
                          "paired_read_bytes_per_s_median": nbytes / md(rd for k in times for rd, _ in times[k]),
                          "steps": len(times["old"]) + len(times["new"])})
    return {"compare": compare, "rounds": per_round, "weight_bytes": nbytes,
            "new_over_old_median": statistics.median(r["new_over_old"] for r in per_round)}


def decode_rounds(model_dir: str, *, dtype: str, prompt_tokens: int, new_tokens: int,
                  rounds: int) -> dict[str, Any]:
    """``rounds`` rounds, each: the read and copy bandwidths (best of 3, fresh buffers), one batch-1 greedy decode
    of ``new_tokens`` tokens with a timed read of a weight-sized buffer before each step after the first token
    (see the module doc), and the read bandwidth again; around them the threads' round trip (`round_trip_ns`,
    before and after: the round's `placement`) and one thread's read. Returns the round of median
    ``fraction_of_limit`` with every round in ``rounds``, each placement's median fraction in
    ``fraction_of_limit_by_placement``, and ``weight_bytes``, ``dtype``.

    Raises:
        ValueError: ``new_tokens`` is below 2 (no step after the first token).
    """
    from kvrelay.model.sampling import SamplingParams

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (a step after the first token), got {new_tokens}")
    loaded, engine, prompt, nbytes, paired = _setup(model_dir, dtype, prompt_tokens)

    def decode(request_id: str) -> tuple[list[float], list[float]]:
        """(read seconds, step seconds) of each step after the first token's."""
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        reads: list[float] = []
        steps: list[float] = []
        started = False
        while engine.has_unfinished():
            t0 = time.perf_counter()
            if started:
                paired.sum()
            t1 = time.perf_counter()
            outs = engine.step()
            t2 = time.perf_counter()
            token = any(o.new_token_ids for o in outs)
            if started and token:  # a step that gave no token (outputs handed over late) is not a decode step
                reads.append(t1 - t0)
                steps.append(t2 - t1)
            started = started or token
        assert len(steps) >= 1, "the decode gave no step after its first token"
        return reads, steps

    decode("warm-up")
    per_round = []
    for r in range(rounds):
        trip_before, one_thread = round_trip_ns(), one_thread_read(paired)
        before, copy = read_bandwidth(repeats=3), copy_bandwidth(repeats=3)
        reads, steps = decode(f"r{r}")
        after = read_bandwidth(repeats=3)
        trip_after = round_trip_ns()
        read = max(before, after)  # the VM's memory can change phase within the decode: the higher one bounds it
        rate = 1.0 / statistics.median(steps)
        peak_limit = read / nbytes
        per_round.append({
            "fraction_of_limit": statistics.median(rd / st for rd, st in zip(reads, steps, strict=True)),
            "decode_tok_s": rate, "step_ms_median": 1e3 / rate,
            "paired_read_bytes_per_s_median": nbytes / statistics.median(reads),
            "fraction_of_peak_limit": rate / peak_limit, "peak_limit_tok_s": peak_limit,
            "read_bytes_per_s": read, "read_before_bytes_per_s": before, "read_after_bytes_per_s": after,
            "copy_bytes_per_s": copy, "one_thread_read_bytes_per_s": one_thread,
            "round_trip_ns_before": trip_before, "round_trip_ns_after": trip_after,
            "placement": placement(trip_before, trip_after), "steps": len(steps)})
    median = sorted(per_round, key=lambda x: x["fraction_of_limit"])[(rounds - 1) // 2]
    by_placement: dict[str, float] = {}
    for kind in ("near", "far", "changed"):
        fractions = [x["fraction_of_limit"] for x in per_round if x["placement"] == kind]
        if fractions:
            by_placement[kind] = statistics.median(fractions)
    return {**median, "rounds": per_round, "fraction_of_limit_by_placement": by_placement, "weight_bytes": nbytes,
            "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch.")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory (e.g. .models/smollm2-135m-instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="bandwidth + decode pairs; the median is reported")
    p.add_argument("--compare", choices=COMPARISONS, default=None,
                   help="instead, alternate one change's old and new path step by step (compare_rounds)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if args.compare is not None:
        measured = compare_rounds(args.model, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                                  new_tokens=args.new_tokens, rounds=args.rounds, compare=args.compare)
    else:
        measured = decode_rounds(args.model, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                                 new_tokens=args.new_tokens, rounds=args.rounds)
    result = {"bench": "bandwidth", "model": args.model, **measured, "torch_threads": torch.get_num_threads(),
              **machine_label()}
    emit(result, args.out)
    return 0
