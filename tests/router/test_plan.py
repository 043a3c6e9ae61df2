"""Issue 31: the plan a request is placed by (`router.plan`), from fixed rates; no network."""

from __future__ import annotations

import dataclasses
import math

import pytest
from kvrelay.engine.step_rates import PullRates
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.router.node_state import Node, NodeCapacity
from kvrelay.router.nodes import Need, NodeSet
from kvrelay.router.plan import (
    CALIBRATION_DECAY,
    COLD_REQUESTS,
    DECODE_TPOT_MISS,
    DISAGGREGATED,
    LOCAL,
    MAX_CALIBRATION_FACTOR,
    MIN_CALIBRATION_REQUESTS,
    REMOTE_TPOT_BREACHES,
    TPOT_BREACHES,
    TTFT_MISSES,
    WHOLE,
    WHOLE_BREACHES,
    PlanChoice,
    StepModel,
    TtftCalibration,
    choose_plan,
    decode_cost_s,
    decode_steps,
)

B = 16
BLOCK_BYTES = 1000


def node(role: str, *, rate: float = 0.0, queued: int = 0, running: int = 0, pull_bytes_per_s: float = 0.0,
         pull_fixed_s: float = 0.0, tokens: int = 512) -> Node:
    n = Node(f"{role}-0", f"http://{role}", role, queued_tokens=queued, reserved_seqs=running)
    n.capacity = NodeCapacity(1000, 1000, 64, tokens, rate, 0.02, block_bytes=BLOCK_BYTES,
                              pull_bytes_per_s=pull_bytes_per_s, pull_fixed_s=pull_fixed_s)
    return n


def plan(mode: str, prompt: int, decode: Node, prefill: Node | None, *, held_d: int = 0, held_p: int = 0,
         calibration: TtftCalibration | None = None) -> PlanChoice:
    return choose_plan(mode, prompt_tokens=prompt, block_size_tokens=B, decode=decode, decode_held_blocks=held_d,
                       prefill=prefill, prefill_held_blocks=held_p, calibration=calibration)


def test_an_idle_decode_node_keeps_a_short_prompt():
    # 100 tokens at 1000 tok/s: local 0.1 s; remote 0.1 s + a pull of 7 blocks (0.01 + 7000 / 1e6 s)
    d = node("decode", rate=1000.0, pull_bytes_per_s=1e6, pull_fixed_s=0.01)
    choice = plan("auto", 100, d, node("prefill", rate=1000.0))
    assert choice == PlanChoice(LOCAL, pytest.approx(0.1), pytest.approx(0.1), {DISAGGREGATED: pytest.approx(0.117),
                                                           LOCAL: pytest.approx(0.1)})


def test_a_long_prompt_goes_to_the_prefill_node_while_the_decode_node_is_busy():
    # 1000 tokens: 1.0 s of compute; 4 sequences running on the decode node would each wait that second
    d = node("decode", rate=1000.0, running=4, pull_bytes_per_s=1e6, pull_fixed_s=0.01)
    choice = plan("auto", 1000, d, node("prefill", rate=1000.0))
    assert choice == PlanChoice(DISAGGREGATED, pytest.approx(1.0), pytest.approx(1.0), {
        DISAGGREGATED: pytest.approx(1.0 + 0.01 + 0.063), LOCAL: pytest.approx(5.0)})


def test_a_prefix_the_decode_node_holds_keeps_the_prompt_there():
    # 62 of the 63 blocks of 1000 tokens on the decode node: 8 tokens left (0.008 s, 5 times with 4 running)
    d = node("decode", rate=1000.0, running=4, pull_bytes_per_s=1e6, pull_fixed_s=0.01)
    choice = plan("auto", 1000, d, node("prefill", rate=1000.0), held_d=62)
    assert choice.plan == LOCAL and choice.predicted_ttft_s == pytest.approx(0.008)
    assert choice.costs == {DISAGGREGATED: pytest.approx(1.0 + 0.01 + 0.001), LOCAL: pytest.approx(0.04)}


def test_a_prefix_on_the_prefill_node_is_pulled_unless_the_link_is_slower_than_recomputing():
    # The prefill node holds the whole 1000-token prompt but one block: 8 tokens to compute there.
    fast = node("decode", rate=1000.0, running=1, pull_bytes_per_s=1e6)
    assert plan("auto", 1000, fast, node("prefill", rate=1000.0), held_p=62).costs == {
        DISAGGREGATED: pytest.approx(0.008 + 0.063), LOCAL: pytest.approx(2.0)}
    # 63 blocks over 1 kB/s: 63 s to pull; recomputing costs 2 s (1 s, and 1 s of the running sequence's)
    slow = node("decode", rate=1000.0, running=1, pull_bytes_per_s=1e3)
    assert plan("auto", 1000, slow, node("prefill", rate=1000.0), held_p=62) == PlanChoice(
        LOCAL, pytest.approx(1.0), pytest.approx(1.0),
        {DISAGGREGATED: pytest.approx(63.008), LOCAL: pytest.approx(2.0)})


def test_queues_count_and_a_decode_node_that_never_prefilled_borrows_the_prefill_rate():
    # prefill node: 3000 tokens queued ahead (3 s); decode node: 400 (0.4 s), 2 running, no rate of its own
    d = node("decode", queued=400, running=2)
    choice = plan("auto", 500, d, node("prefill", rate=1000.0, queued=3000))
    assert choice == PlanChoice(LOCAL, pytest.approx(0.9), pytest.approx(0.9), {DISAGGREGATED: pytest.approx(3.5),
                                                           LOCAL: pytest.approx(0.9 + 2 * 0.5)})


def stepped(role: str, *, fixed: float, token: float, row: float, queued: int = 0, running: int = 0,
            prefill_rate: float = 0.0) -> Node:
    n = Node(f"{role}-0", f"http://{role}", role, queued_tokens=queued, reserved_seqs=running)
    n.capacity = NodeCapacity(1000, 1000, 64, 512, prefill_rate, 0.02, block_bytes=BLOCK_BYTES,
                              pull_bytes_per_s=1e6, step_fixed_s=fixed, step_prefill_token_s=token,
                              step_decode_row_s=row)
    return n


def test_the_fitted_step_cost_prices_each_step_ahead_and_the_decode_step_under_way():
    # decode node: 10 ms a step, 1 ms a prompt token, 2 ms a decode row, 512 tokens a step, 5 running
    d = stepped("decode", fixed=0.01, token=0.001, row=0.002, running=5)
    p = stepped("prefill", fixed=0.05, token=0.002, row=0.0)
    # nothing queued: half of a 20 ms decode step under way, then one step of 20 ms + 100 tokens (0.1 s)
    assert plan("never", 100, d, p).model_ttft_s == pytest.approx(0.01 + 0.02 + 0.1)
    # the prefill node, idle: one step of 50 ms + 200 ms; the pull of 7 blocks (7 ms); the local plan's stall
    # of 0.1 s on each of the 5 streams makes it dearer
    assert plan("auto", 100, d, p) == PlanChoice(DISAGGREGATED, pytest.approx(0.25), pytest.approx(0.25), {
        LOCAL: pytest.approx(0.13 + 5 * 0.1), DISAGGREGATED: pytest.approx(0.25 + 0.007)})
    # 600 tokens queued on the decode node: 700 tokens ahead in two steps of 20 ms (no step under way counted)
    queued = stepped("decode", fixed=0.01, token=0.001, row=0.002, running=5, queued=600)
    assert plan("never", 100, queued, p).model_ttft_s == pytest.approx(2 * 0.02 + 0.7)
    # 1100 tokens queued on the prefill node: 1200 ahead in three steps of 50 ms
    busy_p = stepped("prefill", fixed=0.05, token=0.002, row=0.0, queued=1100)
    assert plan("always", 100, d, busy_p).model_ttft_s == pytest.approx(3 * 0.05 + 2.4)
    # a decode node that fitted only decode steps (no per-token cost) borrows the prefill node's 2 ms a token
    decoding = stepped("decode", fixed=0.01, token=0.0, row=0.002, running=5)
    assert plan("never", 100, decoding, p).model_ttft_s == pytest.approx(0.01 + 0.02 + 0.2)
    # the prefill rate alone (no fit reported) prices it as before: tokens over the rate
    assert plan("never", 100, node("decode", rate=500.0, running=5), p).model_ttft_s == pytest.approx(0.2)


def test_nothing_measured_takes_the_prefill_node_and_the_modes_force_a_plan():
    unmeasured = plan("auto", 100, node("decode"), node("prefill"))
    assert unmeasured.plan == DISAGGREGATED and unmeasured.costs == {}
    assert math.isnan(unmeasured.model_ttft_s) and math.isnan(unmeasured.predicted_ttft_s)
    d, p = node("decode", rate=1000.0), node("prefill", rate=500.0)
    assert plan("always", 100, d, p) == PlanChoice(DISAGGREGATED, pytest.approx(0.2), pytest.approx(0.2), {})
    assert plan("never", 100, d, p) == PlanChoice(LOCAL, pytest.approx(0.1), pytest.approx(0.1), {})
    # no prefill node with room
    assert plan("auto", 100, d, None) == PlanChoice(LOCAL, pytest.approx(0.1), pytest.approx(0.1), {})
    with pytest.raises(ValueError, match="disaggregation must be one of always, never, auto, got 'sometimes'"):
        plan("sometimes", 100, d, p)


def test_a_local_prefill_that_would_push_a_stream_past_the_tpot_slo_goes_to_the_prefill_node():
    # A stream 2 s after its first token, 41 of 64 tokens out (40 ms per token so far), the node's tokens
    # coming every 40 ms: it ends at (2 + 23 · 0.04) / 63 = 46.3 ms per token. A 100-token local prefill
    # (0.1 s) adds 0.1 / 63 = 1.6 ms: 47.9 ms, within a 50 ms SLO; a 300-token one (0.3 s): 51.1 ms, past it.
    # A slow pull (0.5 s fixed) makes local the cheaper plan by cost for both prompts.
    d = node("decode", rate=1000.0, running=1, pull_bytes_per_s=1e6, pull_fixed_s=0.5)
    d.observe_tokens(7, tokens=1, now=0.0, expected=64)
    d.observe_tokens(7, tokens=40, now=1.6, expected=64)  # 40 tokens in 1.6 s: itl 0.04
    assert d.itl_s == pytest.approx(0.04) and d.streams[7].sent == 41
    d.streams[7].first_at = 0.0

    def at(prompt: int, slo: float) -> PlanChoice:
        return choose_plan("auto", prompt_tokens=prompt, block_size_tokens=B, decode=d, decode_held_blocks=0,
                           prefill=node("prefill", rate=1000.0), prefill_held_blocks=0, tpot_slo_s=slo, now=2.0)

    assert d.streams[7].projected_tpot_s(2.0, 0.04, 0.1) == pytest.approx((2 + 23 * 0.04 + 0.1) / 63)
    within = at(100, 0.05)
    assert within.plan == LOCAL and within.costs[TPOT_BREACHES] == 0.0
    past = at(300, 0.05)
    assert past.plan == DISAGGREGATED and past.costs == {DISAGGREGATED: pytest.approx(0.3 + 0.5 + 0.019),
                                                         LOCAL: pytest.approx(0.6), TPOT_BREACHES: 1.0,
                                                         REMOTE_TPOT_BREACHES: 0.0}
    # no SLO: the costs alone keep it local
    assert at(300, 0.0).plan == LOCAL and TPOT_BREACHES not in at(300, 0.0).costs
    # a stream that ended no longer counts
    d.stream_ended(7)
    assert at(300, 0.05).costs[TPOT_BREACHES] == 0.0


def test_a_stream_already_past_the_slo_still_keeps_local_prefills_off_its_node():
    # 5 s for 11 tokens (0.5 s per token): it is past any 50 ms SLO whatever happens, and a local prefill would
    # only add to it; with no prefill node the prompt is local anyway.
    d = node("decode", rate=1000.0, pull_bytes_per_s=1e6, pull_fixed_s=0.01)
    d.observe_tokens(1, tokens=1, now=0.0, expected=64)
    d.observe_tokens(1, tokens=10, now=5.0, expected=64)
    choice = choose_plan("auto", prompt_tokens=32, block_size_tokens=B, decode=d, decode_held_blocks=0,
                         prefill=node("prefill", rate=1000.0), prefill_held_blocks=0, tpot_slo_s=0.05, now=5.0)
    assert choice.plan == DISAGGREGATED and choice.costs[TPOT_BREACHES] == 1.0
    alone = choose_plan("auto", prompt_tokens=32, block_size_tokens=B, decode=d, decode_held_blocks=0,
                        prefill=None, prefill_held_blocks=0, tpot_slo_s=0.05, now=5.0)
    assert alone.plan == LOCAL


def keys(n: int) -> list[BlockKey]:
    return [bytes([i]) * 16 for i in range(n)]


def test_a_request_for_its_prompts_logprobs_is_placed_on_a_prefill_node_whatever_the_mode():
    """Issue 64: the prefill node's answer carries prompt_logprobs, so such a request is placed as under always: on
    a prefill node, or it waits for one's room."""
    for mode in ("auto", "never"):
        nodes = NodeSet(["http://p0"], ["http://d0"], block_size_tokens=B, disaggregation=mode)
        (p,), (d,) = nodes.prefill, nodes.decode
        p.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02)
        d.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02)
        short = Need(prompt_tokens=100, prefill_blocks=7, decode_blocks=8, seqs=1)
        asked = dataclasses.replace(short, needs_prefill_node=True)
        local = nodes.place(short, keys(7))
        assert local.prefill is None and local.choice.plan == LOCAL  # the same prompt, not asking: local
        local.release()
        remote = nodes.place(asked, keys(7))
        assert remote.prefill is p and remote.choice.plan == DISAGGREGATED, mode
        remote.release()
        p.queued_tokens, p.reserved_blocks = 2048, 1  # the prefill node is full: it waits
        assert nodes.place(asked, keys(7)) is None


def test_placing_by_plan_queues_a_local_prompt_on_its_decode_node_and_full_prefill_nodes_go_local_under_auto():
    nodes = NodeSet(["http://p0"], ["http://d0"], block_size_tokens=B, disaggregation="auto")
    (p,), (d,) = nodes.prefill, nodes.decode
    p.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02)
    d.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02)
    short = Need(prompt_tokens=100, prefill_blocks=7, decode_blocks=8, seqs=1)
    local = nodes.place(short, keys(7))
    assert local is not None and local.prefill is None and local.choice.plan == LOCAL
    assert (d.queued_tokens, p.queued_tokens, p.reserved_blocks) == (100, 0, 0)
    local.prefilled()
    assert d.queued_tokens == 0
    local.release()
    # The prefill node is full (its queue bound is 4 steps of 512 tokens): under auto the decode node takes it
    p.queued_tokens, p.reserved_blocks = 2048, 1
    went_local = nodes.place(short, keys(7))
    assert went_local.prefill is None and went_local.choice.plan == LOCAL and d.queued_tokens == 100
    went_local.release()
    nodes.disaggregation = "always"
    assert nodes.place(short, keys(7)) is None  # waits for the prefill node
    p.queued_tokens, p.reserved_blocks = 0, 0
    remote = nodes.place(short, keys(7))
    assert remote.prefill is p and remote.choice.plan == DISAGGREGATED
    assert (p.queued_tokens, d.queued_tokens) == (100, 0)
    with pytest.raises(ValueError, match="disaggregation must be one of"):
        NodeSet([], ["http://d0"], block_size_tokens=B, disaggregation="yes")


def test_pull_rates_fit_a_fixed_time_and_a_bandwidth():
    rates = PullRates()
    assert (rates.bytes_per_s, rates.fixed_s, rates.predict_s(10**6)) == (0.0, 0.0, 0.0)
    rates.observe(10**6, 0.5)  # the first pull runs cold (a new connection): it stands until the second
    assert (rates.bytes_per_s, rates.fixed_s) == (pytest.approx(2e6), 0.0)
    rates.observe(3 * 10**6, 0.031)  # one sample of one size: the ratio, no fixed part
    assert (rates.bytes_per_s, rates.fixed_s) == (pytest.approx(3 * 10**6 / 0.031), 0.0)
    rates.observe(10**6, 0.011)  # the line through both: 0.001 s + bytes / 1e8
    assert (rates.bytes_per_s, rates.fixed_s) == (pytest.approx(1e8), pytest.approx(0.001))
    for size in (2 * 10**6, 5 * 10**6, 10**5):
        rates.observe(size, 0.001 + size / 1e8)
    assert rates.predict_s(4 * 10**6) == pytest.approx(0.041)
    rates.observe(0, 1.0)  # ignored
    rates.observe(10**6, 0.0)
    assert rates.predict_s(4 * 10**6) == pytest.approx(0.041)


def test_calibration_maps_the_model_to_measured_times_and_the_plan_follows_it():
    cal = TtftCalibration()
    assert cal.predict(LOCAL, 0.2) == 0.2  # nothing measured: the model as it is
    for _ in range(COLD_REQUESTS):  # a fresh deployment's first requests run cold: not folded in
        cal.observe(LOCAL, 0.1, 0.6)
    for i in range(MIN_CALIBRATION_REQUESTS - COLD_REQUESTS):  # alternately 2x and 1/2x the model
        assert cal.predict(LOCAL, 0.3) == 0.3  # too few requests yet: the model as it is
        cal.observe(LOCAL, 0.1, 0.2 if i % 2 == 0 else 0.05)
    # the mean in logs of 2 and 1/2 (three each, the newest weighing 1/n): a factor of 1
    assert cal.samples[LOCAL] == MIN_CALIBRATION_REQUESTS and cal.predict(LOCAL, 0.3) == pytest.approx(0.3)
    assert cal.predict(DISAGGREGATED, 0.2) == 0.2
    for _ in range(60):  # steadily 1.5x: the factor decays towards it, each weighing max(CALIBRATION_DECAY, 1/n)
        cal.observe(LOCAL, 0.2, 0.3)
    assert cal.factor(LOCAL) == pytest.approx(1.5, rel=0.1)
    expected = math.exp((1 - CALIBRATION_DECAY) * cal.log_factor[LOCAL] + CALIBRATION_DECAY * math.log(4.0))
    cal.observe(LOCAL, 0.1, 0.4)  # one slow request moves it by one decayed step
    assert cal.factor(LOCAL) == pytest.approx(expected)
    samples = cal.samples[LOCAL]
    cal.observe(LOCAL, float("nan"), 1.0)  # no model time: skipped
    cal.observe(LOCAL, 0.0, 1.0)
    assert cal.samples[LOCAL] == samples
    far = TtftCalibration()  # 20x the model (millisecond prefills behind fixed hops): held to MAX_CALIBRATION_FACTOR
    for _ in range(MIN_CALIBRATION_REQUESTS):
        far.observe(DISAGGREGATED, 0.001, 0.02)
        far.observe(LOCAL, 0.2, 0.01)
    assert far.factor(DISAGGREGATED) == pytest.approx(MAX_CALIBRATION_FACTOR) == 2.0
    assert far.predict(LOCAL, 1.0) == pytest.approx(0.5)
    # A local prefill measured 2x slower than the model loses to an idle prefill node.
    slow_local = TtftCalibration()
    for model_s in (0.1, 0.1, 0.2, 0.4, 0.1, 0.3, 0.2, 0.5):
        slow_local.observe(LOCAL, model_s, 2 * model_s)
    d, p = node("decode", rate=1000.0, pull_bytes_per_s=1e6), node("prefill", rate=1000.0)
    assert plan("auto", 200, d, p).plan == LOCAL
    choice = plan("auto", 200, d, p, calibration=slow_local)
    assert choice == PlanChoice(DISAGGREGATED, pytest.approx(0.2), pytest.approx(0.2), {
        DISAGGREGATED: pytest.approx(0.2 + 0.013), LOCAL: pytest.approx(0.4)})


def test_a_prefill_node_s_own_streams_count_against_the_disaggregated_plan():
    # The prefill node also serves whole requests and runs one stream, as the decode node does (the one of
    # test_a_local_prefill_that_would_push_a_stream_past_the_tpot_slo_goes_to_the_prefill_node): a 300-token
    # prompt (0.3 s either side) pushes a stream past 50 ms wherever it is prefilled, so the cheaper plan stands;
    # its stall on the prefill node's stream now counts in the disaggregated plan's cost.
    def paced(role: str) -> Node:
        n = node(role, rate=1000.0, running=1, pull_bytes_per_s=1e6, pull_fixed_s=0.5)
        n.observe_tokens(7, tokens=1, now=0.0, expected=64)
        n.observe_tokens(7, tokens=40, now=1.6, expected=64)
        n.streams[7].first_at = 0.0
        return n

    d, p = paced("decode"), paced("prefill")
    both = choose_plan("auto", prompt_tokens=300, block_size_tokens=B, decode=d, decode_held_blocks=0, prefill=p,
                       prefill_held_blocks=0, tpot_slo_s=0.05, now=2.0)
    assert both.plan == LOCAL and both.costs == {DISAGGREGATED: pytest.approx(0.3 + 0.5 + 0.019 + 0.3),
                                                 LOCAL: pytest.approx(0.6), TPOT_BREACHES: 1.0,
                                                 REMOTE_TPOT_BREACHES: 1.0}
    d.stream_ended(7)  # only the prefill node's stream would be pushed past: local, though it costs more
    d.reserved_seqs = 3
    alone = choose_plan("auto", prompt_tokens=300, block_size_tokens=B, decode=d, decode_held_blocks=0, prefill=p,
                        prefill_held_blocks=0, tpot_slo_s=0.05, now=2.0)
    assert alone.plan == LOCAL and (alone.costs[LOCAL], alone.costs[DISAGGREGATED]) == (
        pytest.approx(0.3 + 3 * 0.3), pytest.approx(0.3 + 0.5 + 0.019 + 0.3))
    assert (alone.costs[TPOT_BREACHES], alone.costs[REMOTE_TPOT_BREACHES]) == (0.0, 1.0)


def test_auto_places_whole_requests_on_a_prefill_node_that_serves_them_when_it_is_less_loaded():
    # Rates alone (no fitted step cost, no decode weighed): a whole request on the prefill node is priced as a local
    # plan there. 100 tokens at 1000 tok/s; pulling 7 blocks costs the decode node 0.01 + 7000 / 1e6 s.
    nodes = NodeSet(["http://p0"], ["http://d0"], block_size_tokens=B, disaggregation="auto", load_weight_tokens=64)
    (p,), (d,) = nodes.prefill, nodes.decode
    p.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02, whole_requests=True)
    d.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02, block_bytes=BLOCK_BYTES, pull_bytes_per_s=1e6,
                              pull_fixed_s=0.01)
    short = Need(prompt_tokens=100, prefill_blocks=7, decode_blocks=8, seqs=1)
    first = nodes.place(short, keys(7))  # both idle: the decode node wins the tie, and keeps a short prompt
    assert (first.decode, first.prefill, first.choice.plan) == (d, None, LOCAL)
    # The decode node runs one sample and has 100 tokens queued: local 0.2 s + a 0.1 s stall, disaggregated 0.1 +
    # 0.017 s; whole on the idle prefill node 0.1 s
    second = nodes.place(short, keys(7))
    assert (second.decode, second.prefill, second.choice.plan) == (p, None, LOCAL)
    assert (p.reserved_seqs, p.queued_tokens, p.reserved_blocks, d.reserved_seqs) == (1, 100, 8, 1)
    second.prefilled()
    first.prefilled()
    assert (p.queued_tokens, d.queued_tokens) == (0, 0)
    # Equal load again (one sample each: 0.1 s + a 0.1 s stall either way): the decode node; then a prompt queued
    # on the decode node tips it back (local 0.2 + 0.2 s, disaggregated 0.1 + 0.017 + 0.1 s, whole 0.1 + 0.1 s)
    third = nodes.place(short, keys(7))
    assert third.decode is d
    fourth = nodes.place(short, keys(7))
    assert fourth.decode is p
    for r in (first, second, third, fourth):
        r.release()
    assert (p.reserved_seqs, p.reserved_blocks, d.reserved_seqs, d.reserved_blocks) == (0, 0, 0, 0)
    # Not under always or never, and not from a prefill node that does not serve them
    for mode in ("always", "never"):
        nodes.disaggregation = mode
        r1, r2 = nodes.place(short, keys(7)), nodes.place(short, keys(7))
        assert (r1.decode, r2.decode) == (d, d)
        r1.release()
        r2.release()
    nodes.disaggregation = "auto"
    p.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02)
    r1, r2 = nodes.place(short, keys(7)), nodes.place(short, keys(7))
    assert (r1.decode, r2.decode) == (d, d)
    r1.release()
    r2.release()
    # A prefill node that serves them but has no room for the request's decode blocks is not given it
    p.capacity = NodeCapacity(8, 8, 64, 512, 1000.0, 0.02, whole_requests=True)
    p.reserved_blocks = 1
    r1, r2 = nodes.place(short, keys(7)), nodes.place(short, keys(7))
    assert (r1.decode, r2.decode) == (d, d)


def test_before_any_rate_a_whole_request_weighs_the_prefill_queue_its_decode_plan_would_wait_in():
    """Before either node has measured a rate, the less loaded node takes a whole request. When the decode node's
    plan prefills on the prefill node (nothing measured: the prefill node is used), the prompt waits in that node's
    queue either way: the queue counts on both sides, so the prefill node's own samples against the decode
    node's decide."""
    nodes = NodeSet(["http://p0"], ["http://d0"], block_size_tokens=B, disaggregation="auto", load_weight_tokens=64)
    (p,), (d,) = nodes.prefill, nodes.decode
    p.capacity = NodeCapacity(1000, 1000, 64, 512, 0.0, 0.02, whole_requests=True)
    d.capacity = NodeCapacity(1000, 1000, 64, 512, 0.0, 0.02)
    long = Need(prompt_tokens=400, prefill_blocks=25, decode_blocks=26, seqs=1, decode_tokens=64)
    first = nodes.place(long, keys(25))  # both idle: the decode node wins the tie; its plan pulls from p
    assert (first.decode, first.prefill, first.choice.plan) == (d, p, DISAGGREGATED)
    assert (p.queued_tokens, d.reserved_seqs) == (400, 1)
    # p: no samples + 400 queued = 400; d: one sample (64) + p's 400 its plan would wait in = 464: p takes it whole
    second = nodes.place(long, keys(25))
    assert (second.decode, second.prefill) == (p, None)
    assert (p.queued_tokens, p.reserved_seqs) == (800, 1)
    # p: 64 + 800 = 864; d: 64 + 800 = 864: a tie goes to the decode node
    third = nodes.place(long, keys(25))
    assert (third.decode, third.prefill, third.choice.plan) == (d, p, DISAGGREGATED)
    for r in (first, second, third):
        r.release()
    assert (p.reserved_seqs, p.queued_tokens, d.reserved_seqs, d.queued_tokens) == (0, 0, 0, 0)


def test_a_load_report_says_whether_a_prefill_node_serves_whole_requests():
    report = {"kv_blocks": 10, "free_blocks": 10, "max_num_seqs": 4, "max_num_batched_tokens": 64,
              "prefill_tokens_per_s": 0.0, "decode_step_s": 0.0}
    assert NodeCapacity.from_report(report).whole_requests is False
    assert NodeCapacity.from_report({**report, "whole_requests": True}).whole_requests is True
    assert NodeCapacity.from_report({**report, "whole_requests": 1}).whole_requests is False  # only a true bool


def test_a_ttft_slo_weighs_a_plan_s_own_first_token_against_the_streams_it_would_slow():
    # The stream of test_a_local_prefill_that_would_push_a_stream_past_the_tpot_slo_goes_to_the_prefill_node: a
    # 300-token local prefill pushes it past 50 ms (one breach). The prefill node has 500 tokens queued: there the
    # prompt's first token comes after 0.8 s, past a 0.5 s TTFT SLO (one breach); locally after 0.3 s. One breach
    # each: the cheaper plan, local (0.6 s against 0.8 + 0.519 s).
    d = node("decode", rate=1000.0, running=1, pull_bytes_per_s=1e6, pull_fixed_s=0.5)
    d.observe_tokens(7, tokens=1, now=0.0, expected=64)
    d.observe_tokens(7, tokens=40, now=1.6, expected=64)
    d.streams[7].first_at = 0.0

    def at(ttft_slo: float) -> PlanChoice:
        return choose_plan("auto", prompt_tokens=300, block_size_tokens=B, decode=d, decode_held_blocks=0,
                           prefill=node("prefill", rate=1000.0, queued=500), prefill_held_blocks=0,
                           tpot_slo_s=0.05, ttft_slo_s=ttft_slo, now=2.0)

    weighed = at(0.5)
    assert weighed.plan == LOCAL and weighed.costs == {
        DISAGGREGATED: pytest.approx(0.8 + 0.519), LOCAL: pytest.approx(0.6), TPOT_BREACHES: 1.0,
        REMOTE_TPOT_BREACHES: 0.0, TTFT_MISSES[LOCAL]: 0.0, TTFT_MISSES[DISAGGREGATED]: 1.0}
    assert at(1.0).plan == DISAGGREGATED  # both first tokens within 1 s: the stream decides
    assert at(0.0).plan == DISAGGREGATED and TTFT_MISSES[LOCAL] not in at(0.0).costs  # no TTFT SLO


def test_auto_weighs_a_whole_request_s_decode_on_the_prefill_node_against_the_decode_node_s_plan():
    """Fitted step costs on both nodes (10 ms a step, 1 ms a prompt token, 2 ms a decode row); a 400-token prompt
    that decodes 64 tokens. Its decode costs its own 64 steps plus a row in each step of the streams beside it
    (`decode_cost_s`). The decode node runs two streams, the prefill node none: whole on the prefill node (0.41 s
    to the first token, 64 × 12 ms) costs less than the decode node's plan (disaggregated: 0.41 s, a 25-block pull,
    64 × (10 + 5 × 2) ms). With the prefill node busy (four streams, 1,000 tokens queued) the decode node prefills it
    itself; and a plan that breaches an SLO loses to one that does not, whatever it costs."""
    nodes = NodeSet(["http://p0"], ["http://d0"], block_size_tokens=B, disaggregation="auto", tpot_slo_s=0.05)
    (p,), (d,) = nodes.prefill, nodes.decode
    fits = {"step_fixed_s": 0.01, "step_prefill_token_s": 0.001, "step_decode_row_s": 0.002}
    p.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02, whole_requests=True, **fits)
    d.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02, block_bytes=BLOCK_BYTES, pull_bytes_per_s=1e6,
                              **fits)
    d.reserved_seqs = 2
    long = Need(prompt_tokens=400, prefill_blocks=25, decode_blocks=30, seqs=1, decode_tokens=64)
    whole = nodes.place(long, keys(25))
    assert (whole.decode, whole.prefill, whole.choice.plan) == (p, None, LOCAL)
    assert whole.choice.costs == {WHOLE: pytest.approx(0.41 + 64 * 0.012), WHOLE_BREACHES: 0.0}
    assert (p.reserved_seqs, p.queued_tokens, d.reserved_seqs, d.queued_tokens) == (1, 400, 2, 0)
    whole.release()
    # The prefill node busy: whole there 3 steps of 18 ms + 1.4 s, a 0.4 s stall on 4 streams, 64 × 28 ms; the
    # decode node's local plan: half a step under way (7 ms) + one step (14 ms) + 0.4 s, a 0.4 s stall on its 2
    # streams, 64 × 20 ms
    p.reserved_seqs, p.queued_tokens = 4, 1000
    local = nodes.place(long, keys(25))
    assert (local.decode, local.prefill, local.choice.plan) == (d, None, LOCAL)
    assert local.choice.cost_s == pytest.approx(0.421 + 0.8 + 64 * 0.02) and local.choice.breaches == 0
    assert local.choice.costs[DISAGGREGATED] == pytest.approx(1.454 + 0.025 + 4 * 0.4 + 64 * 0.02)
    assert local.choice.costs[DECODE_TPOT_MISS] == 0.0
    local.release()
    # The prefill node idle again, but its inter-token time with one more row would pass the TPOT SLO
    p.reserved_seqs, p.queued_tokens, p.itl_s = 0, 0, 0.049
    pulled = nodes.place(long, keys(25))
    assert (pulled.decode, pulled.prefill, pulled.choice.plan) == (d, p, DISAGGREGATED)
    assert pulled.choice.breaches == 0
    pulled.release()


def test_a_sequence_s_decode_costs_its_own_steps_and_a_row_in_each_step_beside_it():
    steps = StepModel(fixed_s=0.01, token_s=0.001, row_s=0.002, batch_tokens=512)
    assert decode_cost_s(steps, 0, 64) == pytest.approx(64 * 0.012)
    assert decode_cost_s(steps, 3, 64) == pytest.approx(64 * (0.01 + 4 * 0.002) + 3 * 64 * 0.002)
    assert decode_cost_s(steps, 3, 0) == 0.0 and decode_cost_s(None, 0, 64) == 0.0
    # A node that has fitted no step cost borrows the other node's per-step and per-row costs for its decode
    fresh = node("prefill", rate=500.0)
    assert decode_steps(fresh, steps) == StepModel(0.01, 0.002, 0.002, 512)
    assert decode_steps(fresh, None) == StepModel(0.0, 0.002, 0.0, 512)


def test_aggregated_replicas_are_placed_by_the_step_model_where_the_request_costs_least():
    """Two decode nodes, no prefill node: each is priced as a whole request there (`whole_plan`). d0 decodes one
    stream, d1 none but has 600 prompt tokens queued. The load rule would take d1 (no stream); priced, d0 costs
    0.006 + 0.012 + 0.1 s to the first token, a 0.1 s stall on its stream and 64 steps of 14 ms plus 64 rows of
    2 ms on its stream, against d1's two steps and 0.7 s and 64 steps of 12 ms. Past the TPOT SLO on d0, d1 takes
    it."""
    nodes = NodeSet([], ["http://d0", "http://d1"], block_size_tokens=B, disaggregation="auto", tpot_slo_s=0.05)
    d0, d1 = nodes.decode
    for n in (d0, d1):
        n.capacity = NodeCapacity(1000, 1000, 64, 512, 1000.0, 0.02, step_fixed_s=0.01, step_prefill_token_s=0.001,
                                  step_decode_row_s=0.002)
    d0.reserved_seqs, d1.queued_tokens = 1, 600
    short = Need(prompt_tokens=100, prefill_blocks=7, decode_blocks=11, seqs=1, decode_tokens=64)
    assert nodes.pick_decode(keys(7)) is d1
    placed = nodes.place(short, keys(7))
    assert (placed.decode, placed.prefill, placed.choice.plan) == (d0, None, LOCAL)
    assert placed.choice.predicted_ttft_s == pytest.approx(0.118)
    assert (d0.reserved_seqs, d0.queued_tokens, d1.reserved_seqs, d1.queued_tokens) == (2, 100, 0, 600)
    placed.release()
    d0.itl_s = 0.049
    assert nodes.place(short, keys(7)).decode is d1
    nodes.disaggregation = "always"  # no prefill node: its decode node by the load rule, as before
    d0.itl_s = 0.0
    assert nodes.place(short, keys(7)).decode is d0
