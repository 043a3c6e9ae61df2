"""Metric math of `benchmarks.serve_metrics` on records with known timings."""

from __future__ import annotations

import pytest
from kvrelay.benchmarks.serve_client import RequestRecord, RequestSpec
from kvrelay.benchmarks.serve_metrics import (
    CacheCounters,
    cache_delta,
    capacity_blocks,
    parse_goodput,
    parse_prometheus,
    peak_concurrency,
    summarize,
    transfer_bytes_delta,
)


def record(prompt_len: int, send: float, chunks: list[float], tokens: int | None, ok: bool = True) -> RequestRecord:
    r = RequestRecord(RequestSpec(tuple(range(prompt_len)), 8), send_time_s=send, chunk_times_s=chunks,
                      output_tokens=tokens, success=ok)
    return r


# request A: sent at 0, tokens at 0.1, 0.3, 0.6  -> ttft 100 ms, e2el 600 ms, tpot 250 ms, itl 200, 300
# request B: sent at 1, chunks at 1.05, 1.45 carrying 5 tokens -> ttft 50, e2el 450, tpot 100, itl 400
# request C: sent at 2, one token at 2.2 -> ttft 200, e2el 200, no tpot, counts tpot 0 for goodput
# request D: failed
RECORDS = [
    record(10, 0.0, [0.1, 0.3, 0.6], 3),
    record(20, 1.0, [1.05, 1.45], 5),
    record(30, 2.0, [2.2], 1),
    record(40, 3.0, [], None, ok=False),
]


def test_latency_statistics_on_known_timings():
    s = summarize(RECORDS, 4.0)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 9
    assert s["mean_ttft_ms"] == pytest.approx((100 + 50 + 200) / 3)
    assert s["median_ttft_ms"] == pytest.approx(100)
    assert s["mean_e2el_ms"] == pytest.approx((600 + 450 + 200) / 3)
    assert s["mean_tpot_ms"] == pytest.approx((250 + 100) / 2)
    assert s["median_tpot_ms"] == pytest.approx(175)
    assert s["mean_itl_ms"] == pytest.approx((200 + 300 + 400) / 3)
    assert s["p99_itl_ms"] == pytest.approx(300 + 0.98 * 100)  # numpy linear interpolation over [200, 300, 400]
    assert s["p90_ttft_ms"] == pytest.approx(100 + 0.8 * 100)
    assert s["std_ttft_ms"] == pytest.approx(62.3609564, rel=1e-6)


def test_throughputs_divide_by_duration():
    s = summarize(RECORDS, 4.0)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(9 / 4)
    assert s["total_token_throughput"] == pytest.approx(69 / 4)
    assert s["request_goodput"] is None


@pytest.mark.parametrize(("slo", "good"), [
    ({"ttft": 100.0}, 2),                    # A (100 ≤ 100) and B
    ({"ttft": 100.0, "tpot": 200.0}, 1),     # only B: A's TPOT is 250
    ({"tpot": 0.0}, 1),                      # only C, whose TPOT counts as 0
    ({"e2el": 450.0}, 2),                    # B and C
    ({"ttft": 10.0}, 0),
])
def test_goodput_counts_requests_meeting_every_slo(slo, good):
    assert summarize(RECORDS, 2.0, goodput=slo)["request_goodput"] == pytest.approx(good / 2.0)


def test_summary_without_successes_is_all_zero():
    s = summarize([RECORDS[3]], 1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["p99_tpot_ms"] == 0.0


def test_summary_rejects_zero_duration():
    with pytest.raises(ValueError, match="duration_s"):
        summarize(RECORDS, 0.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "tpot:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    for bad, msg in (("ttft", "NAME:MILLISECONDS"), ("itl:5", "not one of"), ("ttft:-1", ">= 0"),
                     ("ttft:abc", "NAME:MILLISECONDS")):
        with pytest.raises(ValueError, match=msg):
            parse_goodput([bad])


def test_peak_concurrency_uses_half_open_intervals():
    # A [0, 0.6), B [1, 1.45), C [2, 2.2): never overlap; a request starting when another ends does not overlap
    assert peak_concurrency(RECORDS[:3]) == 1
    touching = [record(1, 0.0, [1.0], 1), record(1, 1.0, [2.0], 1), record(1, 0.5, [1.5], 1)]
    assert peak_concurrency(touching) == 2


STORE_TEXT = """# HELP kvrelay_prefix_cache_hits_total Blocks found
# TYPE kvrelay_prefix_cache_hits_total counter
kvrelay_prefix_cache_hits_total{tier="device"} 30.0
kvrelay_prefix_cache_hits_total{tier="host"} 5.0
kvrelay_prefix_cache_hits_total{tier="disk"} 1.0
kvrelay_prefix_cache_queries_total 100.0
kvrelay_kv_blocks{state="free",tier="device"} 60.0
kvrelay_kv_blocks{state="cached",tier="device"} 4.0
kvrelay_kv_blocks{state="stored",tier="host"} 10.0
kvrelay_kv_blocks{state="free",tier="host"} 118.0
kvrelay_kv_transfer_bytes_total 4096.0
kvrelay_engine_prefix_hit_tokens_total 480.0
kvrelay_engine_prefill_tokens_total 1000.0
"""


def test_counters_from_store_metrics():
    c = CacheCounters.from_samples(parse_prometheus(STORE_TEXT), block_size_tokens=16, device_blocks=999)
    assert c.tier_to_hit_blocks == {"device": 30.0, "host": 5.0, "disk": 1.0}
    assert c.query_blocks == 100.0
    assert c.tier_to_capacity_blocks == {"device": 64.0, "host": 128.0, "disk": 0.0}
    assert capacity_blocks([c, c]) == 384
    assert c.transfer_bytes == 4096.0


def test_counters_without_store_fall_back_to_engine_tokens():
    text = "kvrelay_engine_prefix_hit_tokens_total 480.0\nkvrelay_engine_prefill_tokens_total 1000.0\n"
    c = CacheCounters.from_samples(parse_prometheus(text), block_size_tokens=16, device_blocks=256)
    assert c.tier_to_hit_blocks == {"device": 30.0, "host": 0.0, "disk": 0.0}
    assert c.query_blocks is None
    assert c.tier_to_capacity_blocks["device"] == 256


def test_cache_delta_per_tier():
    before = CacheCounters.from_samples(parse_prometheus(STORE_TEXT), block_size_tokens=16)
    after_text = STORE_TEXT.replace('"device"} 30.0', '"device"} 60.0').replace("queries_total 100.0",
                                                                                "queries_total 200.0")
    after_text = after_text.replace('"disk"} 1.0', '"disk"} 11.0').replace("bytes_total 4096.0", "bytes_total 8192.0")
    after = CacheCounters.from_samples(parse_prometheus(after_text), block_size_tokens=16)
    d = cache_delta([before], [after], client_query_blocks=12345)
    assert d["source"] == "store" and d["query_blocks"] == 100.0
    assert d["hit_rate"] == pytest.approx({"device": 0.3, "host": 0.0, "disk": 0.1, "total": 0.4})
    assert transfer_bytes_delta([before], [after]) == 4096.0


def test_cache_delta_engine_source_uses_client_queries():
    before = CacheCounters.from_samples({"kvrelay_engine_prefix_hit_tokens_total": 0.0}, block_size_tokens=16)
    after = CacheCounters.from_samples({"kvrelay_engine_prefix_hit_tokens_total": 160.0}, block_size_tokens=16)
    d = cache_delta([before], [after], client_query_blocks=40)
    assert d["source"] == "engine"
    assert d["hit_rate"]["device"] == pytest.approx(10 / 40)
