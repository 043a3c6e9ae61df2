"""`kvrelay bench tracing`'s arithmetic and its receiver's parsing (the bench itself runs deployments: see
`benchmarks.tracing_bench`)."""

from __future__ import annotations

from kvrelay.benchmarks.otlp_receiver import parse_export
from kvrelay.benchmarks.tracing_bench import TARGET_RATIO, combined, round_order, tracing_report
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def test_the_ratio_is_traced_over_untraced_output_throughput():
    report = tracing_report({"output_throughput": 200.0}, {"output_throughput": 196.0}, spans=26, traces=2)
    assert report == {"output_tok_s_off": 200.0, "output_tok_s_on": 196.0, "ratio": 0.98, "target": TARGET_RATIO,
                      "met": True, "spans": 26, "traces": 2}
    assert tracing_report({"output_throughput": 200.0}, {"output_throughput": 190.0}, spans=0, traces=0)["met"] is False
    assert tracing_report({"output_throughput": 0.0}, {"output_throughput": 5.0}, spans=0, traces=0)["ratio"] is None


def test_rounds_alternate_and_combine_by_tokens_over_seconds():
    assert round_order(1) == ["off", "on"]
    assert round_order(3) == ["off", "on", "on", "off", "off", "on"]
    rounds = [{"duration": 60.0, "total_output_tokens": 1800}, {"duration": 40.0, "total_output_tokens": 1400}]
    assert combined(rounds) == {"output_throughput": 32.0}  # 3200 tokens in 100 s, not the mean of 30 and 35
    assert combined([{"duration": 0.0, "total_output_tokens": 0}]) == {"output_throughput": 0.0}


def test_the_receiver_parses_what_the_otlp_exporter_sends():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kvrelay-decode"}), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    root = tracer.start_span("decode.request", start_time=1_000)
    from opentelemetry.trace import set_span_in_context

    tracer.start_span("decode.kv_pull", context=set_span_in_context(root), start_time=1_500,
                      attributes={"blocks": 6, "tier": "device"}).end(end_time=2_500)
    root.end(end_time=3_000)
    spans = parse_export(encode_spans(exporter.get_finished_spans()).SerializeToString())
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == ["decode.kv_pull", "decode.request"]
    pull, req = by_name["decode.kv_pull"], by_name["decode.request"]
    assert (pull.service, pull.parent_id, pull.trace_id) == ("kvrelay-decode", req.span_id, req.trace_id)
    assert pull.attributes == {"blocks": 6, "tier": "device"} and pull.seconds == 1e-6
    assert req.parent_id == "" and (req.start_ns, req.end_ns) == (1_000, 3_000) and not req.error
