"""`benchmarks.goodput_bench` and `benchmarks.goodput_rows`: SLO attainment, goodput from a sweep, the prompt mix,
the router's plan samples and the request rows, on hand-made records and values."""

from __future__ import annotations

import pytest
from kvrelay.benchmarks.goodput_bench import (
    DEPLOYMENT_TO_OVERRIDES,
    Attainment,
    Measured,
    RatePoint,
    Slo,
    attainment,
    deployment_overrides,
    goodput_rate,
    markdown_table,
    mixed_prompts,
    pool,
    router_plan_samples,
    summarize_goodput,
    ttft_error_median,
)
from kvrelay.benchmarks.goodput_rows import handoff, request_rows
from kvrelay.benchmarks.serve_client import RequestRecord, RequestSpec

SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def record(send: float, chunks: list[float], tokens: int | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(RequestSpec((1, 2, 3), 8), send_time_s=send, chunk_times_s=chunks, output_tokens=tokens,
                         success=ok)


# A: ttft 0.5 s, tpot (0.9 - 0.5) / 8 = 0.05 s  -> both (the SLO itself counts as met)
# B: ttft 1.5 s, tpot (1.7 - 1.5) / 4 = 0.05 s  -> tpot only
# C: ttft 0.2 s, tpot (2.2 - 0.2) / 10 = 0.2 s  -> ttft only
# D: ttft 0.8 s, one output token: tpot 0       -> both
# E: failed (its chunks do not count)           -> neither
RECORDS = [
    record(0.0, [0.5, 0.9], 9),
    record(0.0, [1.5, 1.7], 5),
    record(0.0, [0.2, 2.2], 11),
    record(0.0, [0.8], 1),
    record(0.0, [0.1, 0.2], 2, ok=False),
]


def test_attainment_counts_each_slo_and_both_over_every_request_sent():
    assert attainment(RECORDS, SLO) == Attainment(requests=5, both_frac=2 / 5, ttft_frac=3 / 5, tpot_frac=3 / 5)
    assert attainment(RECORDS[:1], Slo(ttft_s=0.4, tpot_s=0.05)) == Attainment(1, 0.0, 0.0, 1.0)


def test_request_rows_name_each_request_and_its_times():
    rec = record(0.0, [0.5, 0.9], 9)
    rec.response_id = "cmpl-1"
    rec.server = {"plan": "disaggregated", "timings": {"kv_pull_s": 0.0345, "ttft_s": 0.5}}
    assert request_rows([rec, RECORDS[4]]) == [
        {"id": "cmpl-1", "prompt_tokens": 3, "ttft_ms": 500.0, "tpot_ms": 50.0, "ok": True,
         "plan": "disaggregated", "kv_pull_ms": 34.5, "stages_ms": {"kv_pull": 34.5, "ttft": 500.0}},
        {"id": "", "prompt_tokens": 3, "ttft_ms": None, "tpot_ms": None, "ok": False, "plan": "",
         "kv_pull_ms": None, "stages_ms": {}}]


def test_handoff_reads_the_disaggregated_requests_pull_and_second_token():
    def disaggregated(chunks: list[float], pull_s: float, ok: bool = True) -> RequestRecord:
        rec = record(0.0, chunks, len(chunks), ok=ok)
        rec.server = {"plan": "disaggregated", "timings": {"kv_pull_s": pull_s}}
        return rec

    local = record(0.0, [0.1, 0.9], 2)
    local.server = {"plan": "local", "timings": {"kv_pull_s": 0.0}}
    records = [disaggregated([0.2, 0.3, 0.35], 0.05), disaggregated([0.2, 0.6], 0.35), disaggregated([0.5], 0.9),
               disaggregated([0.1, 0.2], 2.0, ok=False), local]
    # counted: the first two (a single token has no second; a failed one and a local one are not hand-offs)
    got = handoff(records)
    assert got == {"requests": 2, "kv_pull_ms_median": 200.0, "kv_pull_ms_p90": 320.0,
                   "second_token_ms_median": 250.0, "second_token_ms_p90": 370.0}
    assert handoff([local]) == {} and handoff(RECORDS) == {}


def test_rounds_pool_their_requests_per_workload_and_rate():
    # round 1 at rate 1: A and B (1 of 2 both); round 2 at rate 1: C, D, E (1 of 3); rate 2 only once: D
    measured = [Measured("mixed", 1.0, RECORDS[:2], 2.0), Measured("mixed", 2.0, RECORDS[3:4], 1.0),
                Measured("mixed", 1.0, RECORDS[2:], 3.0)]
    points = pool("auto", measured, SLO)
    assert [(p.deployment, p.workload, p.rate, p.rounds) for p in points] == [("auto", "mixed", 1.0, 2),
                                                                              ("auto", "mixed", 2.0, 1)]
    assert points[0].attainment == attainment(RECORDS, SLO)  # every request of both rounds, as one run
    assert points[0].stats["completed"] == 4 and points[0].stats["failed"] == 1
    assert points[0].stats["request_throughput"] == 4 / 5.0  # over the rounds' summed wall time
    assert len(points[0].requests) == 5 and points[1].requests == tuple(request_rows(RECORDS[3:4]))
    assert points[1].attainment == Attainment(1, 1.0, 1.0, 1.0)


def test_attainment_of_nothing_is_refused():
    with pytest.raises(ValueError, match="attainment of no requests"):
        attainment([], SLO)


def test_goodput_is_the_highest_rate_reaching_the_target():
    assert goodput_rate({0.5: 1.0, 1.0: 0.95, 2.0: 0.5, 4.0: 0.1}, target_frac=0.9) == 1.0
    assert goodput_rate({0.5: 1.0, 1.0: 27 / 30, 2.0: 26 / 30}, target_frac=0.9) == 1.0  # 27/30 is exactly 90 %
    assert goodput_rate({0.5: 0.85, 1.0: 0.92, 2.0: 0.4}, target_frac=0.9) == 1.0  # a dip below does not end it
    assert goodput_rate({0.5: 0.8, 1.0: 0.2}, target_frac=0.9) == 0.0
    assert goodput_rate({}, target_frac=0.9) == 0.0


def test_mixed_prompts_have_the_exact_long_share_and_lengths_in_range():
    specs = mixed_prompts(num_requests=10, long_share_frac=0.3, short_tokens=(5, 8), long_tokens=(100, 120),
                          output_tokens=7, seed="t", vocab=50)
    lengths = [len(s.prompt_token_ids) for s in specs]
    assert sum(n >= 100 for n in lengths) == 3
    assert all(5 <= n <= 8 or 100 <= n <= 120 for n in lengths)
    assert all(s.max_tokens == 7 and max(s.prompt_token_ids) < 50 for s in specs)
    again = mixed_prompts(num_requests=10, long_share_frac=0.3, short_tokens=(5, 8), long_tokens=(100, 120),
                          output_tokens=7, seed="t", vocab=50)
    other = mixed_prompts(num_requests=10, long_share_frac=0.3, short_tokens=(5, 8), long_tokens=(100, 120),
                          output_tokens=7, seed="u", vocab=50)
    assert again == specs and other != specs
    assert [len(s.prompt_token_ids) for s in mixed_prompts(
        num_requests=4, long_share_frac=0.0, short_tokens=(3, 3), long_tokens=(9, 9), output_tokens=1, seed="t",
        vocab=5)] == [3, 3, 3, 3]


def test_mixed_prompts_refuse_a_bad_share_or_range():
    kwargs = {"num_requests": 4, "output_tokens": 1, "seed": "t", "vocab": 5}
    with pytest.raises(ValueError, match="long share must be in"):
        mixed_prompts(long_share_frac=1.5, short_tokens=(1, 2), long_tokens=(3, 4), **kwargs)
    with pytest.raises(ValueError, match="long prompt lengths 9-4"):
        mixed_prompts(long_share_frac=0.5, short_tokens=(1, 2), long_tokens=(9, 4), **kwargs)
    with pytest.raises(ValueError, match="short prompt lengths 0-2"):
        mixed_prompts(long_share_frac=0.5, short_tokens=(0, 2), long_tokens=(3, 4), **kwargs)


def test_router_plan_samples_are_kept_verbatim_and_nothing_else():
    text = ('# HELP kvrelay_router_plans_total Plans\n'
            'kvrelay_router_plans_total{plan="local"} 3.0\n'
            'kvrelay_router_plan_ttft_error_ratio_sum{plan="disaggregated"} 0.25\n'
            'kvrelay_router_queued_requests 0.0\n')
    assert router_plan_samples(text) == {'kvrelay_router_plans_total{plan="local"}': 3.0,
                                         'kvrelay_router_plan_ttft_error_ratio_sum{plan="disaggregated"}': 0.25}
    assert router_plan_samples("kvrelay_router_queued_requests 0.0\n") == {}


def test_the_median_ttft_error_is_read_from_the_router_histogram_per_plan_and_overall():
    def buckets(plan: str, counts: dict[str, float]) -> dict[str, float]:
        return {f'kvrelay_router_plan_ttft_error_ratio_bucket{{le="{le}",plan="{plan}"}}': c
                for le, c in counts.items()}

    # local: 10 samples, 4 up to 0.05, 8 up to 0.1: the 5th of 10 lies a quarter into (0.05, 0.1]
    local = buckets("local", {"0.05": 4, "0.1": 8, "0.25": 10, "+Inf": 10})
    # disaggregated: 2 samples, both past 0.25: the +Inf bucket's lower bound
    remote = buckets("disaggregated", {"0.05": 0, "0.1": 0, "0.25": 0, "+Inf": 2})
    samples = {**local, **remote, 'kvrelay_router_plans_total{plan="local"}': 10.0,
               **buckets("empty", {"0.05": 0, "+Inf": 0})}
    # all: 12 samples, 4 / 8 / 10 / 12: the 6th lies half-way into (0.05, 0.1]
    assert ttft_error_median(samples) == {"disaggregated": 0.25, "local": pytest.approx(0.0625),
                                          "all": pytest.approx(0.075)}
    assert ttft_error_median({}) == {}


def point(deployment: str, workload: str, rate: float, both: float) -> RatePoint:
    return RatePoint(deployment, workload, rate, Attainment(10, both, both, both), {})


def test_summarize_goodput_gives_auto_over_the_best_other_and_over_2x_aggregated():
    points = [point("2x-aggregated", "long", 0.5, 1.0), point("2x-aggregated", "long", 1.0, 0.5),
              point("1p1d", "long", 0.5, 0.9), point("1p1d", "long", 1.0, 0.8),
              point("auto", "long", 0.5, 1.0), point("auto", "long", 1.0, 0.9),
              point("2x-aggregated", "chat", 0.5, 0.1), point("1p1d", "chat", 0.5, 0.2),
              point("auto", "chat", 0.5, 1.0)]
    assert summarize_goodput(points, target_frac=0.9) == {
        "long": {"goodput_req_s": {"2x-aggregated": 0.5, "1p1d": 0.5, "auto": 1.0}, "auto_over_best_other": 2.0,
                 "auto_over_2x_aggregated": 2.0},
        "chat": {"goodput_req_s": {"2x-aggregated": 0.0, "1p1d": 0.0, "auto": 0.5}, "auto_over_best_other": None,
                 "auto_over_2x_aggregated": None},
    }
    only_two = [p for p in points if p.deployment != "auto"]
    assert summarize_goodput(only_two, target_frac=0.9)["long"] == {"goodput_req_s": {"2x-aggregated": 0.5,
                                                                                      "1p1d": 0.5}}


def test_markdown_table_marks_rates_not_run():
    points = [point("2x-aggregated", "long", 0.5, 0.95), point("auto", "long", 0.5, 1.0),
              point("auto", "long", 1.0, 0.9)]
    assert markdown_table(points, summarize_goodput(points, target_frac=0.9), rates=[0.5, 1.0]) == (
        "| workload | deployment | 0.5 req/s | 1 req/s | goodput (req/s) |\n"
        "|---|---|---|---|---|\n"
        "| long | 2x-aggregated | 0.95 | – | 0.5 |\n"
        "| long | auto | 1.00 | 0.90 | 1 |")


def test_every_deployment_is_told_the_slos_and_keeps_its_own_plan():
    slo = Slo(1.0, 0.04)
    told = {"tpot_slo_s": 0.04, "ttft_slo_s": 1.0}
    auto = deployment_overrides("auto", slo)
    assert auto == {"prefill": {"ports": [0], "serve_whole_requests": True}, "decode": {"ports": [0]},
                    "router": {"disaggregation": "auto", **told}}
    assert deployment_overrides("1p1d", slo) == {"prefill": {"ports": [0]}, "decode": {"ports": [0]},
                                                 "router": {"disaggregation": "always", **told}}
    agg = deployment_overrides("2x-aggregated", slo)
    assert agg == {"prefill": {"ports": []}, "decode": {"ports": [0, 0]}, "router": told}
    assert "router" not in DEPLOYMENT_TO_OVERRIDES["2x-aggregated"]  # the table itself is left as it was


def test_a_multihost_deployment_binds_each_host_to_its_own_address_and_names_every_node(tmp_path):
    """`--network netns`: what each host's process reads (no namespace is made here)."""
    from kvrelay.benchmarks.netns import Hosts
    from kvrelay.benchmarks.netns_deployment import NetnsDeployment

    d = NetnsDeployment(tmp_path, overrides=deployment_overrides("auto", Slo(3.0, 0.2)))
    try:
        assert d.node_hosts == ["prefill-0", "decode-0"]
        d._hosts = Hosts(["router", *d.node_hosts], tmp_path)
        router, prefill, decode = (d._hosts.addr(h) for h in ("router", "prefill-0", "decode-0"))
        cfg = d.host_config("decode-0")
        assert cfg["internal"]["bind"] == decode and cfg["decode"]["ports"] == [8200]
        r = cfg["router"]
        assert (r["host"], r["port"], r["disaggregation"], r["tpot_slo_s"], r["prefill_urls"], r["decode_urls"]) == (
            router, 8000, "auto", 0.2, [f"http://{prefill}:8100"], [f"http://{decode}:8200"])
        assert cfg["kvstore"]["disk"]["path"] == str(d.work / "decode-0" / "disk")
        assert cfg["kvstore"]["device"] == {"bytes": "2GiB"} and cfg["model"]["path"] == str(tmp_path.resolve())
        assert d.host_config("prefill-0")["internal"]["bind"] == prefill
        agg = NetnsDeployment(tmp_path, overrides=deployment_overrides("2x-aggregated", Slo(3.0, 0.2)))
        assert agg.node_hosts == ["decode-0", "decode-1"]
        # No prefill host, so no prefill port: an empty router.prefill_urls would mean one per local port
        agg._hosts = Hosts(["router", *agg.node_hosts], tmp_path)
        agg_cfg = agg.host_config("router")
        assert (agg_cfg["prefill"]["ports"], agg_cfg["router"]["prefill_urls"]) == ([], [])
        assert cfg["prefill"]["ports"] == [8100]
        agg._hosts = None
        agg.stop()
    finally:
        d._hosts = None
        d.stop()
