"""vLLM's request-level metric families, measured at the router: the one place that sees a request end to end.

Names, types, label sets (``model_name``, ``engine``) and buckets are vLLM 0.32's (``vllm/v1/metrics/loggers.py``);
which service exports which family is in `node.vllm_metrics`. One *sample* is one choice of an answer (a prompt
with ``n=3`` is three samples, as vLLM counts its child requests). Times, per sample, in seconds::

    arrival ── parse ── queue ────────── prefill ──────────── first token ── decode ── last token
    │                   router_queue_s + the node queue       │                        │
    │                   before its compute (prefill node:     │                        │
    │                   prefill_queue_s; local: decode_...)   │                        │
    ├─ vllm:time_to_first_token_seconds ──────────────────────┤                        │
    ├─ vllm:e2e_request_latency_seconds ───────────────────────────────────────────────┤
                        ├─ request_queue_time ┤─ request_prefill_time ┤─ request_decode_time ┤
                                              ├─ request_inference_time (prefill + decode) ┤

``vllm:inter_token_latency_seconds`` (and its old name ``vllm:time_per_output_token_seconds``, same observations)
takes one observation per output token after the first: a frame of k tokens that arrives g seconds after the
previous one counts k observations of g/k (tokens that came in the sample's first frame count 0), so that its
``_sum / _count`` is the mean time per output token. ``vllm:request_time_per_output_token_seconds`` takes one per
sample with two tokens or more: its decode time over its tokens after the first.

A sample that ends normally counts in ``vllm:request_success_total`` under its finish reason (``stop``, ``length``;
a tool call ends as ``stop``) and in every latency and length family; a request that fails after admission counts
each of its samples under ``error``, one the client dropped under ``abort``, and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvrelay.node.vllm_metrics import ENGINE, LABELS, buckets_1_2_5
from kvrelay.router.request_trace import RequestTrace
from prometheus_client import CollectorRegistry, Counter, Histogram

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                             240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values, as its label writes them


def vllm_finish_reason(reason: str | None) -> str:
    """The ``finished_reason`` label of an answer's finish reason: ``length`` and ``abort`` as they are, anything
    else that ended a sample normally (``stop``, ``tool_calls``, a stop string) ``stop``."""
    return reason if reason in ("length", "abort") else "stop"


class VllmRequestMetrics:
    """The router's vLLM families in ``registry``, every child (each finish reason too) made at construction so that
    each series exists at 0 before the first request. ``max_model_len`` bounds the token-count buckets
    (`buckets_1_2_5`)."""

    def __init__(self, registry: CollectorRegistry, *, model_name: str, max_model_len: int) -> None:
        v = (model_name, ENGINE)
        tokens = buckets_1_2_5(max_model_len)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets).labels(*v)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival at the router to the sample's first "
                              "token", TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens at the router (one "
                             "observation per token after the first)", ITL_BUCKETS_S)
        self.itl_old_name = histogram("vllm:time_per_output_token_seconds", "The observations of "
                                      "vllm:inter_token_latency_seconds, under vLLM's older name", ITL_BUCKETS_S)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds", "A sample's decode time over "
                                      "its output tokens after the first", ITL_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival at the router to the sample's last token",
                             REQUEST_LATENCY_BUCKETS_S)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting for room: the router's queue and "
                               "the node's before the prompt's compute", REQUEST_LATENCY_BUCKETS_S)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "End of the queue wait to the sample's first "
                                 "token", REQUEST_LATENCY_BUCKETS_S)
        self.decode = histogram("vllm:request_decode_time_seconds", "The sample's first token to its last",
                                REQUEST_LATENCY_BUCKETS_S)
        self.inference = histogram("vllm:request_inference_time_seconds", "Prefill time plus decode time",
                                   REQUEST_LATENCY_BUCKETS_S)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of each sample", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Output tokens of each sample", tokens)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens of each prompt", tokens)
        self.n = histogram("vllm:request_params_n", "The n of each prompt", N_BUCKETS)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens", "The most output tokens of "
                                               "any sample of each prompt", tokens)
        success = Counter("vllm:request_success", "Samples that ended, by finish reason", [*LABELS,
                          "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*v, reason) for reason in FINISH_REASONS}

    def inter_token(self, gap_s: float, num_tokens: int) -> None:
        """``num_tokens`` output tokens (after a sample's first) arrived ``gap_s`` after the previous ones."""
        each_s = gap_s / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(each_s)
            self.itl_old_name.observe(each_s)


class SampleClock:
    """When each sample (choice) of one API request got its tokens, and vLLM's observations of them.

    ``prompt_of_choice[i]``: the index in ``trace.runs`` (and ``prompts``) of choice i's prompt; ``prompts``: per
    prompt, ``(prompt tokens, n, max_tokens)``. Only the request's handler task calls it; each of `finished` /
    `failed` is called at most once, and nothing after it."""

    def __init__(self, metrics: VllmRequestMetrics, trace: RequestTrace, *, prompt_of_choice: Sequence[int],
                 prompts: Sequence[tuple[int, int, int]]) -> None:
        self._metrics = metrics
        self._trace = trace
        self._prompt_of_choice = list(prompt_of_choice)
        self._prompts = list(prompts)
        count = len(self._prompt_of_choice)
        self.first_ns: list[int | None] = [None] * count
        self.last_ns = [0] * count
        self.num_tokens = [0] * count

    def tokens(self, index: int, num_tokens: int) -> None:
        """``num_tokens`` (≥ 0) output tokens of choice ``index`` reached the router now."""
        if not num_tokens:
            return
        now = time.time_ns()
        if self.first_ns[index] is None:
            self.first_ns[index] = now
            if num_tokens > 1:
                self._metrics.inter_token(0.0, num_tokens - 1)
        else:
            self._metrics.inter_token((now - self.last_ns[index]) / 1e9, num_tokens)
        self.last_ns[index] = now
        self.num_tokens[index] += num_tokens

    def finished(self, reasons: Sequence[str | None]) -> None:
        """Every sample ended normally (``reasons[i]``: choice i's finish reason): observe them all, and each
        prompt's parameters."""
        m, trace = self._metrics, self._trace
        for i, k in enumerate(self._prompt_of_choice):
            m.success[vllm_finish_reason(reasons[i])].inc()
            first_ns = self.first_ns[i]
            prompt_tokens = self._prompts[k][0]
            m.prompt_tokens.observe(prompt_tokens)
            m.generation_tokens.observe(self.num_tokens[i])
            if first_ns is None:
                continue  # ended without a token (e.g. max_tokens reached by a resumed sample): no times
            run = trace.runs[k]
            node_queue = "prefill_queue_s" if run.plan == "disaggregated" else "decode_queue_s"
            queue_s = run.timings.get("router_queue_s", 0.0) + run.timings.get(node_queue, 0.0)
            parse_s = (run.admitted_ns - trace.arrived_ns) / 1e9
            ttft_s = (first_ns - trace.arrived_ns) / 1e9
            prefill_s = max(0.0, ttft_s - parse_s - queue_s)
            decode_s = (self.last_ns[i] - first_ns) / 1e9
            m.ttft.observe(ttft_s)
            m.e2e.observe((self.last_ns[i] - trace.arrived_ns) / 1e9)
            m.queue.observe(queue_s)
            m.prefill.observe(prefill_s)
            m.decode.observe(decode_s)
            m.inference.observe(prefill_s + decode_s)
            if self.num_tokens[i] > 1:
                m.request_tpot.observe(decode_s / (self.num_tokens[i] - 1))
        for k, (_, n, max_tokens) in enumerate(self._prompts):
            m.max_tokens.observe(max_tokens)
            m.n.observe(n)
            m.max_generation_tokens.observe(max((self.num_tokens[i] for i, p in enumerate(self._prompt_of_choice)
                                                 if p == k), default=0))

    def failed(self, reason: str) -> None:
        """The request ended without finishing (``reason``: ``error`` or ``abort``): count each sample under it."""
        self._metrics.success[reason].inc(len(self._prompt_of_choice))
