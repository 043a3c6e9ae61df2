"""`choose_plan`: where a request's prompt is prefilled — on a prefill node, whose KV the decode node then pulls
("disaggregated"), or on its decode node itself ("local") — from rates the nodes measured (`NodeCapacity`).

For a request of ``P`` prompt tokens whose leading ``h_p`` / ``h_d`` tokens the prefill / decode node holds (the
router's `KvIndex`), each node's step cost as it measured it (`StepModel`: seconds per step ``f``, per prompt token
``c``, per decode row ``r``; its token budget per step ``B``), with ``Q`` prompt tokens already placed on that
node and not yet prefilled, ``R`` sequences decoding there, and the decode node's fitted pull time ``pull(bytes)``:

    ttft(Q, T, R) = wait + ⌈(Q + T) / B⌉ · (f + r·R) + c · (Q + T)      wait = (f + r·R) / 2 when Q = 0 < R (a
                                                                         decode step is under way), else 0
    disaggregated:  ttft = ttft_p(Q_p, P - h_p, R_p)      cost = ttft + pull((blocks(P) - blocks(h_d)) · block_bytes)
                                                                + R_p · c_p · (P - h_p) + decode_d(N)
    local:          ttft = ttft_d(Q_d, P - h_d, R_d)      cost = ttft + R_d · c_d · (P - h_d) + decode_d(N)
    whole on X:     ttft = ttft_x(Q_x, P - h_x, R_x)      cost = ttft + R_x · c_x · (P - h_x) + decode_x(N)
                                                          (`whole_plan`)
    decode_x(N) = N · (f + r·(R_x + 1)) + R_x · N · r     (`decode_cost_s`: the request's own N decode steps, and
                                                          its row in each step of the R_x streams beside it)

``N``, the tokens the request is expected to decode, is 0 where the caller does not weigh the decode; it is the
same in both plans of one decode node, and makes them comparable with a whole request on another node (a prefill
node that serves whole requests, or another decode node: `router.nodes.NodeSet.place`).

A node that reports no fitted step cost yet is priced by its prefill rate alone (``c`` = 1 / rate, ``f`` = ``r`` =
0: ``ttft = (Q + T) / rate``).

The first token of a disaggregated request comes from the prefill node, so its pull delays only its second
token; the pull is part of its cost, not of its TTFT. A local prefill shares the decode node's steps with the
``R_d`` sequences decoding there (chunked prefill), and delays each of them by its compute time: that is
the cost it puts on others, counted once per running sequence. A prefill node has no sequences of its own
(``R_p`` = 0) unless it also serves whole requests (`router.nodes.NodeSet.place`). So a short prompt, or
one whose prefix the decode node holds (``P - h_d`` small), stays on the decode node, a long one goes to a
prefill node while the decode node is busy, and when the prefill node's queue or a slow link outweighs the
stall, the decode node recomputes.

Plans are weighed against the SLOs first. The TPOT SLO (``router.tpot_slo_s``): each
stream's time per output token when it ends is projected from what it has sent, the node's decayed
inter-token time as the router receives it, and the stall (`router.node_state.StreamPace`); under ``auto``,
the plan that pushes fewer streams past the SLO is taken (a prefill node's own streams count against the
disaggregated plan; with ``router.ttft_slo_s`` set, a plan whose calibrated TTFT passes it counts one breach
more), and only on a tie the cheaper one. Otherwise on short chat prompts the decode node takes
every prefill itself and its streams' TPOT creeps past the SLO while the prefill node idles (a stall of ~0.1 s
costs each stream only ~1.6 ms per token, but a stream lives through dozens of them).

The model's TTFT leaves out what it cannot see (the hops between router and nodes, how far the step under way
has got, a prompt's attention growing with its length), so the router calibrates it per plan against the times
it then measures (`TtftCalibration`: actual ≈ factor · model, the factor a decayed mean in logs), and plans by
the calibrated times.

A decode node that has never prefilled has no per-token cost of its own: the prefill node's stands in for it (the same
model; ``kvrelay up`` gives each node an equal share of the CPUs). Nothing measured yet (no rate on either): the
prefill node is used, as under ``always``. No prefill rate is configured by hand.

Modes (``router.disaggregation``): ``always`` — a prefill node whenever one is up and has room; ``never`` — every
prompt on its decode node; ``auto`` (default) — the cheaper plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from kvrelay.router.node_state import Node, NodeCapacity

TPOT_BREACHES = "local_tpot_breaches"  # `PlanChoice.costs`: streams a local prefill would push past the SLO
# ... and those the prefill node's prefill would (its own streams, when it also serves whole requests)
REMOTE_TPOT_BREACHES = "disaggregated_tpot_breaches"
# ... and, with a TTFT SLO, whether each plan's calibrated TTFT passes it (1.0) or not (0.0)
TTFT_MISSES = {"local": "local_ttft_miss", "disaggregated": "disaggregated_ttft_miss"}
# ... and, weighing the request's decode, whether the decode node's inter-token time with its row passes the TPOT
# SLO (1.0) or not (0.0): one breach more in either plan
DECODE_TPOT_MISS = "decode_tpot_miss"
# `whole_plan`'s cost and breaches of a request placed whole on a prefill node
WHOLE = "whole"
WHOLE_BREACHES = "whole_breaches"

MODES = ("always", "never", "auto")
# weight of the newest request in `TtftCalibration`'s factor: slower than the step averages, since consecutive
# requests of one workload differ more than consecutive steps (0.1 gave median |error| 0.11-0.14, 0.03 0.09-0.12,
# the uncalibrated model 0.08-0.11: the Zen 4 VM's goodput run of 2026-12-05)
CALIBRATION_DECAY = 0.03
# ... and the factor is held within [1 / MAX_CALIBRATION_FACTOR, MAX_CALIBRATION_FACTOR]: past it the model misses
# something that does not scale with it (the hops of a tiny model's millisecond prefills, a machine stalled for a
# while), which a factor would multiply into every long prompt's price
MAX_CALIBRATION_FACTOR = 2.0
# ... the first COLD_REQUESTS requests of a plan are not folded in (a fresh deployment's first steps run several
# times slower: one gave 6x the model), and the factor applies from MIN_CALIBRATION_REQUESTS on
COLD_REQUESTS = 2
MIN_CALIBRATION_REQUESTS = 8
DISAGGREGATED = "disaggregated"
LOCAL = "local"


@dataclass(frozen=True, slots=True)
class PlanChoice:
    """The plan taken, the TTFT the model gives it (``model_ttft_s``, seconds from placement to the first token;
    NaN: no rate measured yet) and that TTFT calibrated (``predicted_ttft_s``; `TtftCalibration`).

    ``costs``: each plan considered and its cost (seconds; `choose_plan`), and, when a TPOT SLO is set, how many
    streams each plan would push past it (`TPOT_BREACHES`, `REMOTE_TPOT_BREACHES`), and when a TTFT SLO is set,
    whether each plan's predicted TTFT passes it (`TTFT_MISSES`); empty when the mode left no choice.
    """

    plan: str
    model_ttft_s: float
    predicted_ttft_s: float
    costs: dict[str, float]
    # the plan taken's SLO breaches and cost (seconds), as `choose_plan` weighed them (0 and NaN where it did not)
    breaches: int = field(default=0, compare=False)
    cost_s: float = field(default=math.nan, compare=False)


class TtftCalibration:
    """Per plan, the factor by which actual times from placement to first token exceed the model's: ``actual ≈
    factor · model``, ``log factor`` a decayed mean of ``log(actual / model)`` (the newest request weighs
    ``max(CALIBRATION_DECAY, 1 / n)``). A ratio in logs, not a fitted line: one slow request (a cold first one, a
    hiccup of a shared machine) moves it by a bounded step and it decays, where an offset fitted to a few such
    requests mispriced the next ones by more than the model's own error (measured on the Zen 4 VM: median
    |error| 0.18 with the fitted line, 0.12 the model as it is). A plan predicts the model's time as it
    is until `MIN_CALIBRATION_REQUESTS` of its requests were measured, the first `COLD_REQUESTS` not counted. Owned
    by the router's event loop."""

    def __init__(self) -> None:
        self.samples = {plan: 0 for plan in (DISAGGREGATED, LOCAL)}
        self.log_factor = {plan: 0.0 for plan in (DISAGGREGATED, LOCAL)}

    def observe(self, plan: str, model_s: float, actual_s: float) -> None:
        """One request placed by ``plan`` whose model time was ``model_s`` took ``actual_s``; NaN or a time ≤ 0
        is skipped."""
        if not (model_s > 0 and actual_s > 0):  # NaN fails both
            return
        n = self.samples[plan] = self.samples[plan] + 1
        sample = math.log(actual_s / model_s)
        if n <= COLD_REQUESTS:
            return
        weight = max(CALIBRATION_DECAY, 1.0 / (n - COLD_REQUESTS))
        self.log_factor[plan] = (1 - weight) * self.log_factor[plan] + weight * sample

    def factor(self, plan: str) -> float:
        """``actual / model`` for ``plan`` (1.0 until `MIN_CALIBRATION_REQUESTS` were measured), held within
        `MAX_CALIBRATION_FACTOR` either way."""
        if self.samples[plan] < MIN_CALIBRATION_REQUESTS:
            return 1.0
        bound = math.log(MAX_CALIBRATION_FACTOR)
        return math.exp(min(bound, max(-bound, self.log_factor[plan])))

    def predict(self, plan: str, model_s: float) -> float:
        return model_s * self.factor(plan)


def prefill_rate(node: Node) -> float:
    """The node's measured prefill rate (tokens/s); 0.0 before it reported one."""
    return node.capacity.prefill_tokens_per_s if node.capacity is not None else 0.0


@dataclass(frozen=True, slots=True)
class StepModel:
    """What a node's steps cost (module docstring): ``fixed_s`` per step, ``token_s`` per prompt token,
    ``row_s`` per decode row, at most ``batch_tokens`` prompt tokens per step."""

    fixed_s: float
    token_s: float
    row_s: float
    batch_tokens: int

    @classmethod
    def of(cls, node: Node, stand_in: StepModel | None = None) -> StepModel | None:
        """``node``'s reported step cost (`NodeCapacity` ``step_*``), or its prefill rate alone while it has no
        fitted per-token cost; ``stand_in``'s per-token cost when it has neither, and ``stand_in`` as it is when
        ``node`` has reported nothing yet. None: nothing to price by."""
        cap = node.capacity
        if cap is None:
            return stand_in
        token_s = cap.step_prefill_token_s or (1.0 / cap.prefill_tokens_per_s if cap.prefill_tokens_per_s > 0
                                               else 0.0)
        if token_s <= 0:
            if stand_in is None:
                return None
            token_s = stand_in.token_s
        fitted = cap.step_prefill_token_s > 0 or cap.step_decode_row_s > 0
        return cls(cap.step_fixed_s if fitted else 0.0, token_s, cap.step_decode_row_s if fitted else 0.0,
                   max(1, cap.max_num_batched_tokens))

    def ttft_s(self, queued: int, tokens: int, running: int) -> float:
        """Seconds until a prompt of ``tokens`` uncached tokens, placed behind ``queued`` prompt tokens on a
        node decoding ``running`` sequences, has its first token (module docstring)."""
        ahead = max(0, queued) + max(0, tokens)
        step = self.fixed_s + self.row_s * running
        wait = step / 2 if queued <= 0 < running else 0.0
        return wait + max(1, -(-ahead // self.batch_tokens)) * step + self.token_s * ahead if ahead else wait


def running(node: Node) -> int:
    """Sequences decoding or placed on ``node`` (the router's count)."""
    return max(node.in_flight, node.reserved_seqs)


def pull_s(cap: NodeCapacity | None, blocks: int) -> float:
    """Seconds the decode node with capacity ``cap`` is predicted to take to pull ``blocks`` 16-token blocks;
    0.0 while it has not pulled yet or has not reported its block size."""
    if cap is None or blocks <= 0 or cap.pull_bytes_per_s <= 0 or cap.block_bytes <= 0:
        return 0.0
    return cap.pull_fixed_s + blocks * cap.block_bytes / cap.pull_bytes_per_s


def node_itl_s(node: Node) -> float:
    """``node``'s inter-token time: the router's `Node.itl_s`, else the node's reported decode step (0.0: none)."""
    return node.itl_s or (node.capacity.decode_step_s if node.capacity is not None else 0.0)


def tpot_breaches(node: Node, *, stall_s: float, tpot_slo_s: float, now: float, row_s: float = 0.0) -> int:
    """How many of the streams decoding on ``node`` a stall of ``stall_s`` seconds would end past ``tpot_slo_s``
    (their projected TPOT, `StreamPace.projected_tpot_s`, at the node's measured inter-token time, `node_itl_s`,
    plus ``row_s``: a new sequence decoding beside them makes each of their steps that much longer). 0 when no SLO
    is set (``tpot_slo_s`` ≤ 0)."""
    if tpot_slo_s <= 0 or not node.streams:
        return 0
    itl = node_itl_s(node) + row_s
    return sum(p.projected_tpot_s(now, itl, stall_s) > tpot_slo_s for p in node.streams.values())


def decode_cost_s(steps: StepModel | None, running_seqs: int, tokens: int) -> float:
    """Seconds that ``tokens`` decode tokens of one more sequence cost on a node with step cost ``steps`` decoding
    ``running_seqs`` sequences, counted as the plans count a prefill (its own time plus the delay it puts on
    others): its own decode, ``tokens`` steps of ``fixed_s + row_s · (running_seqs + 1)`` (a decode step reads every
    weight whatever its rows), plus ``row_s`` a step on each of the ``running_seqs`` streams beside it for as long
    (``tokens · (fixed_s + row_s · (2 · running_seqs + 1))``). So a busy node costs more than an idle one, as its
    stall does. 0.0 without a step model or tokens."""
    if steps is None or tokens <= 0:
        return 0.0
    running_seqs = max(0, running_seqs)
    return tokens * (steps.fixed_s + steps.row_s * (2 * running_seqs + 1))


def decode_steps(node: Node, stand_in: StepModel | None) -> StepModel | None:
    """`StepModel.of` ``node``, with ``stand_in``'s per-step and per-row costs where the node has fitted neither
    (a node that has not decoded yet: the same model on an equal share of the CPUs)."""
    steps = StepModel.of(node, stand_in)
    if steps is not None and stand_in is not None and steps.fixed_s == 0 and steps.row_s == 0:
        return StepModel(stand_in.fixed_s, steps.token_s, stand_in.row_s, steps.batch_tokens)
    return steps


def choose_plan(mode: str, *, prompt_tokens: int, block_size_tokens: int, decode: Node, decode_held_blocks: int,
                prefill: Node | None, prefill_held_blocks: int,
                calibration: TtftCalibration | None = None, tpot_slo_s: float = 0.0,
                ttft_slo_s: float = 0.0, now: float | None = None, decode_tokens: int = 0) -> PlanChoice:
    """The plan for one request (module docstring). ``prefill`` None: no prefill node is up with room, so the
    plan is local whatever the mode. ``*_held_blocks``: the leading blocks of the prompt each node holds.
    ``calibration``: maps model TTFTs to predicted ones (None: the model's as they are). ``tpot_slo_s``: the
    TPOT SLO a local prefill must keep the decode node's streams within (0: none); ``ttft_slo_s``: the TTFT SLO
    (0: none), a plan whose calibrated TTFT passes it counting one breach (`TTFT_MISSES` keys); ``now``:
    `time.monotonic` seconds (None: read it). ``decode_tokens``: the tokens the request is expected to decode on
    its decode node (0: not weighed): both plans then cost their decode too (`decode_cost_s`), its rows count
    against the decode node's streams (`tpot_breaches`' ``row_s``), and a plan breaches once more when the decode
    node's inter-token time with its row would pass the TPOT SLO (`DECODE_TPOT_MISS`). The same in both plans,
    these do not change which of them is taken; they make it comparable with a whole request on a prefill node
    (`whole_plan`).

    Raises:
        ValueError: ``mode`` is not one of `MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"disaggregation must be one of {', '.join(MODES)}, got {mode!r}")
    cal = calibration or TtftCalibration()
    remote_steps = StepModel.of(prefill) if prefill is not None else None
    local_steps = StepModel.of(decode, remote_steps)
    held_d = min(prompt_tokens, decode_held_blocks * block_size_tokens)
    local_compute = local_steps.token_s * (prompt_tokens - held_d) if local_steps is not None else math.nan
    local_model = (local_steps.ttft_s(decode.queued_tokens, prompt_tokens - held_d, running(decode))
                   if local_steps is not None else math.nan)
    local = PlanChoice(LOCAL, local_model, cal.predict(LOCAL, local_model), {})
    if prefill is None or mode == "never":
        return local
    held_p = min(prompt_tokens, prefill_held_blocks * block_size_tokens)
    remote_model = (remote_steps.ttft_s(prefill.queued_tokens, prompt_tokens - held_p, prefill.reserved_seqs)
                    if remote_steps is not None else math.nan)
    remote = PlanChoice(DISAGGREGATED, remote_model, cal.predict(DISAGGREGATED, remote_model), {})
    if mode == "always" or math.isnan(local_model) or math.isnan(remote_model):
        return remote
    assert remote_steps is not None
    blocks = -(-prompt_tokens // block_size_tokens)
    remote_compute = remote_steps.token_s * (prompt_tokens - held_p)
    rows = decode_steps(decode, remote_steps)
    decode_s = decode_cost_s(rows, running(decode), decode_tokens)  # the same decode either way
    # (a prefill node serving whole requests stalls its own streams with it)
    costs = {DISAGGREGATED: remote.predicted_ttft_s + pull_s(decode.capacity, blocks - decode_held_blocks)
             + prefill.reserved_seqs * remote_compute + decode_s,
             LOCAL: local.predicted_ttft_s + running(decode) * local_compute + decode_s}
    breaches = {LOCAL: 0, DISAGGREGATED: 0}
    if ttft_slo_s > 0:
        misses = {plan: int(choice.predicted_ttft_s > ttft_slo_s) for plan, choice in ((LOCAL, local),
                                                                                        (DISAGGREGATED, remote))}
        costs.update({TTFT_MISSES[plan]: float(miss) for plan, miss in misses.items()})
        breaches = misses
    if tpot_slo_s > 0:
        now = time.monotonic() if now is None else now
        row_s = rows.row_s if rows is not None and decode_tokens > 0 else 0.0
        tpot = {LOCAL: tpot_breaches(decode, stall_s=local_compute, tpot_slo_s=tpot_slo_s, now=now, row_s=row_s),
                DISAGGREGATED: tpot_breaches(prefill, stall_s=remote_compute, tpot_slo_s=tpot_slo_s, now=now)
                + (tpot_breaches(decode, stall_s=0.0, tpot_slo_s=tpot_slo_s, now=now, row_s=row_s) if row_s else 0)}
        costs[TPOT_BREACHES] = float(tpot[LOCAL])
        costs[REMOTE_TPOT_BREACHES] = float(tpot[DISAGGREGATED])
        if decode_tokens > 0:
            own = int(node_itl_s(decode) + row_s > tpot_slo_s)
            costs[DECODE_TPOT_MISS] = float(own)
            tpot = {plan: n + own for plan, n in tpot.items()}
        breaches = {plan: breaches[plan] + tpot[plan] for plan in breaches}
    # Fewer SLO breaches first (streams pushed past the TPOT SLO, this request's TTFT past its SLO); then the
    # cheaper plan (local on a tie).
    chosen = LOCAL if (breaches[LOCAL], costs[LOCAL]) <= (breaches[DISAGGREGATED], costs[DISAGGREGATED]) \
        else DISAGGREGATED
    taken = local if chosen == LOCAL else remote
    return PlanChoice(taken.plan, taken.model_ttft_s, taken.predicted_ttft_s, costs, breaches[chosen],
                      costs[chosen])


def whole_plan(node: Node, *, prompt_tokens: int, held_blocks: int, block_size_tokens: int, decode_tokens: int,
               stand_in: StepModel | None, calibration: TtftCalibration | None = None, tpot_slo_s: float = 0.0,
               ttft_slo_s: float = 0.0, now: float | None = None) -> PlanChoice:
    """A request placed whole on ``node`` (a prefill node that serves whole requests, or one of several decode
    nodes: it prefills the prompt, whose leading ``held_blocks`` blocks it holds, and decodes ``decode_tokens``),
    priced as `choose_plan` prices a local plan: its calibrated TTFT, the stall its prefill puts on the node's
    streams, and its decode (`decode_cost_s`: its own steps and its row in the steps of the node's streams). Its
    breaches (``breaches``), as there: its TTFT past the TTFT SLO, the node's streams pushed past the TPOT SLO, and
    the node's inter-token time with the new row past it. ``stand_in``: another node's step model (the decode
    node's, beside a prefill node), for what this node has not fitted (`decode_steps`); None: the node's own only.
    ``plan`` is `LOCAL` (the node prefills what it decodes, and its TTFT calibrates as local ones do); ``costs``
    holds `WHOLE` (the cost) and `WHOLE_BREACHES`. Nothing to price the node by: NaN times and cost, no costs."""
    cal = calibration or TtftCalibration()
    steps, rows = StepModel.of(node, stand_in), decode_steps(node, stand_in)
    if steps is None or rows is None:
        return PlanChoice(LOCAL, math.nan, math.nan, {}, 0, math.nan)
    tokens = prompt_tokens - min(prompt_tokens, held_blocks * block_size_tokens)
    compute = steps.token_s * tokens
    model = steps.ttft_s(node.queued_tokens, tokens, running(node))
    predicted = cal.predict(LOCAL, model)
    cost = predicted + running(node) * compute + decode_cost_s(rows, running(node), decode_tokens)
    breaches = int(ttft_slo_s > 0 and predicted > ttft_slo_s)
    if tpot_slo_s > 0:
        now = time.monotonic() if now is None else now
        row_s = rows.row_s if decode_tokens > 0 else 0.0
        breaches += tpot_breaches(node, stall_s=compute, tpot_slo_s=tpot_slo_s, now=now, row_s=row_s)
        breaches += int(decode_tokens > 0 and node_itl_s(node) + row_s > tpot_slo_s)
    return PlanChoice(LOCAL, model, predicted, {WHOLE: cost, WHOLE_BREACHES: float(breaches)}, breaches, cost)
