"""`choose_plan`: where a request's prompt is prefilled — on a prefill node, whose KV the decode node then pulls
("disaggregated"), or on its decode node itself ("local") — from rates the nodes measured (`NodeCapacity`).

For a request of ``P`` prompt tokens whose leading ``h_p`` / ``h_d`` tokens the prefill / decode node holds (the
router's `KvIndex`), with ``Q`` prompt tokens already placed on that node and not yet prefilled, each node's
measured prefill rate ``r`` (tokens/s), and the decode node's fitted pull time ``pull(bytes)``:

    disaggregated:  ttft = (Q_p + P - h_p) / r_p        cost = ttft + pull((blocks(P) - blocks(h_d)) · block_bytes)
                                                               + running_p · (P - h_p) / r_p
    local:          ttft = (Q_d + P - h_d) / r_d        cost = ttft + running_d · (P - h_d) / r_d

The first token of a disaggregated request comes from the prefill node, so its pull delays only its second
token; the pull is part of its cost, not of its TTFT. A local prefill shares the decode node's steps with the
``running_d`` sequences decoding there (chunked prefill), and delays each of them by its compute time: that is
the cost it puts on others, counted once per running sequence. A prefill node has no sequences of its own
(``running_p`` = 0) unless it also serves whole requests (`router.nodes.NodeSet.place`). So a short prompt, or
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

The model's TTFT leaves out what it cannot see (the hops between router and nodes, a step already running, a
decode node sharing its steps), so the router calibrates it per plan against the times it then measures
(`TtftCalibration`: actual ≈ a + b · model, fitted online), and plans by the calibrated times.

A decode node that has never prefilled has no rate of its own: the prefill node's stands in for it (the same
model; ``kvrelay up`` gives each node an equal share of the CPUs). Nothing measured yet (no rate on either): the
prefill node is used, as under ``always``. No prefill rate is configured by hand.

Modes (``router.disaggregation``): ``always`` — a prefill node whenever one is up and has room; ``never`` — every
prompt on its decode node; ``auto`` (default) — the cheaper plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from engine.step_rates import DecayedLine
from router.node_state import Node, NodeCapacity

TPOT_BREACHES = "local_tpot_breaches"  # `PlanChoice.costs`: streams a local prefill would push past the SLO
# ... and those the prefill node's prefill would (its own streams, when it also serves whole requests)
REMOTE_TPOT_BREACHES = "disaggregated_tpot_breaches"
# ... and, with a TTFT SLO, whether each plan's calibrated TTFT passes it (1.0) or not (0.0)
TTFT_MISSES = {"local": "local_ttft_miss", "disaggregated": "disaggregated_ttft_miss"}

MODES = ("always", "never", "auto")
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


class TtftCalibration:
    """Per plan, the actual time from placement to first token against the model's (`DecayedLine`: ``actual ≈
    a + b · model``; an offset until it can fit). A plan predicts the model's time as it is until two of its
    requests were measured (the first on a fresh deployment runs cold). Owned by the router's event loop."""

    def __init__(self) -> None:
        self.lines = {plan: DecayedLine(fallback="offset") for plan in (DISAGGREGATED, LOCAL)}

    def observe(self, plan: str, model_s: float, actual_s: float) -> None:
        """One request placed by ``plan`` whose model time was ``model_s`` took ``actual_s``; NaN is skipped."""
        if not (math.isnan(model_s) or math.isnan(actual_s)):
            self.lines[plan].observe(model_s, actual_s)

    def predict(self, plan: str, model_s: float) -> float:
        line = self.lines[plan]
        return model_s if line.samples < 2 or math.isnan(model_s) else max(0.0, line.predict(model_s))


def prefill_rate(node: Node) -> float:
    """The node's measured prefill rate (tokens/s); 0.0 before it reported one."""
    return node.capacity.prefill_tokens_per_s if node.capacity is not None else 0.0


def running(node: Node) -> int:
    """Sequences decoding or placed on ``node`` (the router's count)."""
    return max(node.in_flight, node.reserved_seqs)


def pull_s(cap: NodeCapacity | None, blocks: int) -> float:
    """Seconds the decode node with capacity ``cap`` is predicted to take to pull ``blocks`` 16-token blocks;
    0.0 while it has not pulled yet or has not reported its block size."""
    if cap is None or blocks <= 0 or cap.pull_bytes_per_s <= 0 or cap.block_bytes <= 0:
        return 0.0
    return cap.pull_fixed_s + blocks * cap.block_bytes / cap.pull_bytes_per_s


def tpot_breaches(node: Node, *, stall_s: float, tpot_slo_s: float, now: float) -> int:
    """How many of the streams decoding on ``node`` a stall of ``stall_s`` seconds would end past ``tpot_slo_s``
    (their projected TPOT, `StreamPace.projected_tpot_s`, at the node's measured inter-token time — the
    router's `Node.itl_s`, else the node's reported decode step). 0 when no SLO is set (``tpot_slo_s`` ≤ 0)."""
    if tpot_slo_s <= 0 or not node.streams:
        return 0
    itl = node.itl_s or (node.capacity.decode_step_s if node.capacity is not None else 0.0)
    return sum(p.projected_tpot_s(now, itl, stall_s) > tpot_slo_s for p in node.streams.values())


def choose_plan(mode: str, *, prompt_tokens: int, block_size_tokens: int, decode: Node, decode_held_blocks: int,
                prefill: Node | None, prefill_held_blocks: int,
                calibration: TtftCalibration | None = None, tpot_slo_s: float = 0.0,
                ttft_slo_s: float = 0.0, now: float | None = None) -> PlanChoice:
    """The plan for one request (module docstring). ``prefill`` None: no prefill node is up with room, so the
    plan is local whatever the mode. ``*_held_blocks``: the leading blocks of the prompt each node holds.
    ``calibration``: maps model TTFTs to predicted ones (None: the model's as they are). ``tpot_slo_s``: the
    TPOT SLO a local prefill must keep the decode node's streams within (0: none); ``ttft_slo_s``: the TTFT SLO
    (0: none), a plan whose calibrated TTFT passes it counting one breach (`TTFT_MISSES` keys); ``now``:
    `time.monotonic` seconds (None: read it).

    Raises:
        ValueError: ``mode`` is not one of `MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"disaggregation must be one of {', '.join(MODES)}, got {mode!r}")
    cal = calibration or TtftCalibration()
    r_p = prefill_rate(prefill) if prefill is not None else 0.0
    r_d = prefill_rate(decode) or r_p
    held_d = min(prompt_tokens, decode_held_blocks * block_size_tokens)
    local_compute = (prompt_tokens - held_d) / r_d if r_d > 0 else math.nan
    local_model = (decode.queued_tokens / r_d + local_compute) if r_d > 0 else math.nan
    local = PlanChoice(LOCAL, local_model, cal.predict(LOCAL, local_model), {})
    if prefill is None or mode == "never":
        return local
    held_p = min(prompt_tokens, prefill_held_blocks * block_size_tokens)
    remote_model = (prefill.queued_tokens + prompt_tokens - held_p) / r_p if r_p > 0 else math.nan
    remote = PlanChoice(DISAGGREGATED, remote_model, cal.predict(DISAGGREGATED, remote_model), {})
    if mode == "always" or math.isnan(local_model) or math.isnan(remote_model):
        return remote
    blocks = -(-prompt_tokens // block_size_tokens)
    remote_compute = (prompt_tokens - held_p) / r_p
    costs = {DISAGGREGATED: remote.predicted_ttft_s + pull_s(decode.capacity, blocks - decode_held_blocks)
             + prefill.reserved_seqs * remote_compute,  # a prefill node serving whole requests stalls its own
             LOCAL: local.predicted_ttft_s + running(decode) * local_compute}
    breaches = {LOCAL: 0, DISAGGREGATED: 0}
    if ttft_slo_s > 0:
        misses = {plan: int(choice.predicted_ttft_s > ttft_slo_s) for plan, choice in ((LOCAL, local),
                                                                                        (DISAGGREGATED, remote))}
        costs.update({TTFT_MISSES[plan]: float(miss) for plan, miss in misses.items()})
        breaches = misses
    if tpot_slo_s > 0:
        now = time.monotonic() if now is None else now
        tpot = {LOCAL: tpot_breaches(decode, stall_s=local_compute, tpot_slo_s=tpot_slo_s, now=now),
                DISAGGREGATED: tpot_breaches(prefill, stall_s=remote_compute, tpot_slo_s=tpot_slo_s, now=now)}
        costs[TPOT_BREACHES] = float(tpot[LOCAL])
        costs[REMOTE_TPOT_BREACHES] = float(tpot[DISAGGREGATED])
        breaches = {plan: breaches[plan] + tpot[plan] for plan in breaches}
    # Fewer SLO breaches first (streams pushed past the TPOT SLO, this request's TTFT past its SLO); then the
    # cheaper plan (local on a tie).
    chosen = local if (breaches[LOCAL], costs[LOCAL]) <= (breaches[DISAGGREGATED], costs[DISAGGREGATED]) else remote
    return PlanChoice(chosen.plan, chosen.model_ttft_s, chosen.predicted_ttft_s, costs)
