"""`benchmarks.structured_bench`: the schema set, the requests, the TPOT / validity arithmetic on hand-made records
and the command line; no servers."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kvrelay.benchmarks.serve_client import RequestRecord, RequestSpec
from kvrelay.benchmarks.structured_bench import (
    NAME_TO_SCHEMA,
    NAME_TO_SUBJECTS,
    CompileTimes,
    PassStats,
    chat_body,
    errors_of,
    is_valid,
    make_tasks,
    markdown_table,
    matched_max_tokens,
    parse_args,
    pass_stats,
    probe_schema,
    tpot_ratios,
)
from kvrelay.router.structured_api import check_compiles, structured_from_body


def _walk(schema: dict[str, Any], path: str = "$"):
    """Every (path, subschema) of ``schema``: properties, items and anyOf branches."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    for i, sub in enumerate(schema.get("anyOf", [])):
        yield from _walk(sub, f"{path}|{i}")


def test_every_schema_is_valid_per_its_metaschema_and_passes_the_routers_check():
    for name, schema in NAME_TO_SCHEMA.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        out, param = structured_from_body({"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": name, "schema": schema}}})
        assert param is not None and param.startswith("response_format") and out is not None and out.kind == "json"
        check_compiles(out, param)


def test_the_schema_set_covers_nesting_enums_arrays_required_and_bounded_strings():
    assert list(NAME_TO_SCHEMA) == ["person", "product", "address", "event", "recipe", "weather", "ticket", "book"]
    assert list(NAME_TO_SUBJECTS) == list(NAME_TO_SCHEMA)
    nested = [name for name, s in NAME_TO_SCHEMA.items()
              if any(p != "$" and sub.get("type") == "object" for p, sub in _walk(s))]
    assert nested == ["address", "event", "recipe", "weather", "book"]
    keywords = {key for s in NAME_TO_SCHEMA.values() for _, sub in _walk(s) for key in sub}
    assert {"enum", "maxLength", "pattern", "required", "items", "maxItems", "anyOf", "minimum"} <= keywords
    assert all(s["required"] and s["additionalProperties"] is False for s in NAME_TO_SCHEMA.values())
    # nothing a small model could extend forever: every string, array and integer is bounded
    unbounded = [f"{name}:{p}" for name, s in NAME_TO_SCHEMA.items() for p, sub in _walk(s)
                 if (sub.get("type") == "string" and not {"maxLength", "enum", "pattern"} & set(sub))
                 or (sub.get("type") == "array" and "maxItems" not in sub)
                 or (sub.get("type") == "integer" and not {"minimum", "maximum"} <= set(sub))]
    assert unbounded == []


def test_every_schema_converts_to_an_xgrammar_grammar():
    from kvrelay.engine.grammar import grammar_of

    for name, schema in NAME_TO_SCHEMA.items():
        out, _ = structured_from_body({"response_format": {"type": "json_schema",
                                                           "json_schema": {"name": name, "schema": schema}}})
        assert "root ::=" in str(grammar_of(out))


def test_sixteen_tasks_use_every_schema_with_both_subjects_once():
    tasks = make_tasks(16)
    assert [t.schema_name for t in tasks] == list(NAME_TO_SCHEMA) * 2
    assert len({t.prompt for t in tasks}) == 16
    assert tasks[0].prompt.startswith("Describe a fictional software engineer who lives in Lisbon. Reply with only")
    assert tasks[8].prompt.startswith("Describe a retired school teacher who volunteers at a library. Reply")
    assert tasks[0].prompt.endswith(json.dumps(NAME_TO_SCHEMA["person"], separators=(",", ":")))
    assert [t.schema_name for t in make_tasks(3)] == ["person", "product", "address"]
    assert make_tasks(17)[16] == tasks[0]


def test_constrained_bodies_stop_at_the_grammar_and_unconstrained_ones_decode_max_tokens():
    schema = NAME_TO_SCHEMA["book"]
    assert chat_body("m", "hi", max_tokens=7, schema=("book", schema)) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "book", "schema": schema, "strict": True}}}
    free = chat_body("m", "hi", max_tokens=7, schema=None)
    assert free["ignore_eos"] is True and "response_format" not in free and free["max_tokens"] == 7


def test_a_probe_schema_is_the_same_grammar_under_a_new_cache_key():
    schema = NAME_TO_SCHEMA["person"]
    probe = probe_schema(schema, "3")
    assert probe == {**schema, "title": "probe-3"} and "title" not in schema

    def key(s: dict[str, Any]) -> tuple:
        body = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": s}}}
        return structured_from_body(body)[0].cache_key

    assert key(probe) != key(schema) and key(probe) == key(probe_schema(schema, "3"))


PERSON_OK = {"name": "Ana", "age": 34, "roles": ["admin", "viewer"]}


@pytest.mark.parametrize(("value", "valid"), [
    (PERSON_OK, True),
    ({**PERSON_OK, "email": "ana@example.com"}, True),
    ({**PERSON_OK, "roles": ["owner"]}, False),  # not in the enum
    ({**PERSON_OK, "roles": []}, False),  # minItems 1
    ({**PERSON_OK, "name": "A" * 33}, False),  # maxLength 32
    ({**PERSON_OK, "age": 121}, False),
    ({"name": "Ana", "age": 34}, False),  # roles is required
    ({**PERSON_OK, "city": "Lisbon"}, False),  # additionalProperties
])
def test_validity_is_json_schema_validation_of_the_parsed_output(value: dict[str, Any], valid: bool):
    assert is_valid(json.dumps(value), NAME_TO_SCHEMA["person"]) is valid


def test_output_that_is_not_json_is_invalid():
    assert is_valid('{"name": "Ana", "age": 3', NAME_TO_SCHEMA["person"]) is False
    assert is_valid("", NAME_TO_SCHEMA["person"]) is False


def record(chunks: list[float], tokens: int | None, *, max_tokens: int = 16, text: str = "",
           ok: bool = True, error: str = "") -> RequestRecord:
    return RequestRecord(RequestSpec((), max_tokens), send_time_s=0.0, chunk_times_s=chunks, output_tokens=tokens,
                         generated_text=text, success=ok, error=error)


# A: ttft 0.5 s, tpot (1.5 - 0.5) / 10 = 0.1 s      (valid JSON)
# B: ttft 0.25 s, tpot (2.25 - 0.25) / 8 = 0.25 s   (stopped at max_tokens 9: truncated, invalid)
# C: ttft 0.75 s, one token: no tpot                 (valid JSON)
# D: failed                                          (invalid)
RECORDS = [
    record([0.5, 1.0, 1.5], 11, text=json.dumps(PERSON_OK)),
    record([0.25, 2.25], 9, max_tokens=9, text='{"name": "Ana", "age'),
    record([0.75], 1, text=json.dumps(PERSON_OK)),
    record([], None, ok=False, error="HTTP 400: bad schema"),
]


def test_pass_stats_use_vllm_bench_serves_tpot_over_successful_requests():
    stats = pass_stats(RECORDS)
    assert stats == PassStats(requests=4, failed=1, mean_ttft_ms=pytest.approx(500.0),
                              median_ttft_ms=pytest.approx(500.0), mean_tpot_ms=pytest.approx(175.0),
                              median_tpot_ms=pytest.approx(175.0), p90_tpot_ms=pytest.approx(235.0),
                              mean_output_tokens=pytest.approx(7.0), truncated=None, valid_frac=None)


def test_a_constrained_pass_counts_valid_outputs_over_every_request_sent_and_truncations():
    stats = pass_stats(RECORDS, [NAME_TO_SCHEMA["person"]] * 4)
    assert (stats.truncated, stats.valid_frac) == (1, 0.5)
    with pytest.raises(ValueError, match="3 schemas for 4 records"):
        pass_stats(RECORDS, [NAME_TO_SCHEMA["person"]] * 3)


def test_an_empty_or_failed_pass_has_no_times():
    stats = pass_stats(RECORDS[3:], [NAME_TO_SCHEMA["person"]])
    assert stats == PassStats(1, 1, None, None, None, None, None, None, truncated=0, valid_frac=0.0)


def test_tpot_ratios_are_constrained_over_unconstrained():
    def stats(mean: float | None, median: float | None) -> PassStats:
        return PassStats(16, 0, 100.0, 100.0, mean, median, None, 50.0)

    assert tpot_ratios(stats(55.0, 44.0), stats(50.0, 40.0)) == {"mean": pytest.approx(1.1),
                                                                   "median": pytest.approx(1.1)}
    assert tpot_ratios(stats(55.0, None), stats(0.0, 40.0)) == {"mean": None, "median": None}


def test_unconstrained_lengths_match_the_constrained_twins():
    assert matched_max_tokens(RECORDS, fallback=384) == [11, 9, 1, 384]
    assert matched_max_tokens([record([0.1], 0)], fallback=384) == [1]


def test_errors_are_distinct_and_in_order():
    recs = [record([], None, ok=False, error=e) for e in ("b", "a", "b", "c", "d")]
    assert errors_of(recs) == ["b", "a", "c"]
    assert errors_of(RECORDS) == ["HTTP 400: bad schema"]


def test_compile_summary():
    times = CompileTimes(setup_ms=[900.0, 1100.0], schema_to_ms={"a": [10.0, 30.0], "b": [5.0, 15.0]})
    assert times.summary() == {"repeats": 2, "setup_ms": 1000.0, "mean_ms": 15.0, "max_ms": 30.0,
                               "per_schema": {"a": {"mean_ms": 20.0, "max_ms": 30.0},
                                              "b": {"mean_ms": 10.0, "max_ms": 15.0}}}


def test_the_table_has_one_row_per_server():
    free = PassStats(16, 0, 300.0, 290.0, 50.0, 48.0, 60.0, 80.0)
    warm = PassStats(16, 0, 310.0, 300.0, 52.5, 50.4, 62.0, 80.0, truncated=0, valid_frac=1.0)
    cold = PassStats(16, 0, 900.0, 880.0, 60.0, 58.0, 70.0, 80.0, truncated=1, valid_frac=0.9375)
    server = {"passes": {"unconstrained": asdict(free), "constrained": asdict(warm), "cold": asdict(cold)},
              "tpot_ratio": {"mean": 1.05, "median": 1.05}, "cold_tpot_ratio": {"mean": 1.2, "median": 1.21},
              "probe_ttft_cold_minus_warm_ms": None}
    lines = markdown_table({"kvrelay": server}).splitlines()
    assert len(lines) == 3
    assert lines[2] == "| kvrelay | 50.0 / 48.0 | 52.5 / 50.4 | 1.050 | 1.050 | 1.200 | 1.00; 0.94 | – |"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_arguments_default_to_the_full_run(model_dir: Path):
    a = parse_args(["--model", str(model_dir)])
    assert (a.concurrency, a.max_tokens, a.repeats, a.probes, a.compile_repeats) == (16, 384, 3, 8, 5)
    assert (a.no_vllm, a.disaggregation, a.vllm_args, a.out) == (False, "always", "", None)


def test_quick_shortens_what_is_not_given(model_dir: Path):
    a = parse_args(["--model", str(model_dir), "--quick", "--no-vllm", "--probes", "20", "--concurrency", "4"])
    assert (a.concurrency, a.repeats, a.probes, a.compile_repeats, a.no_vllm) == (4, 1, 8, 1, True)


@pytest.mark.parametrize(("argv", "message"), [
    (["--concurrency", "0"], "--concurrency 0: must be at least 1"),
    (["--max-tokens", "1"], "--max-tokens 1: must be at least 2"),
    (["--repeats", "0"], "--repeats 0: must be at least 1"),
    (["--disaggregation", "sometimes"], "invalid choice: 'sometimes'"),
])
def test_bad_arguments_are_refused(model_dir: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", str(model_dir), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_model_directory_without_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path / "nope")])
    assert "is not a model directory; `kvrelay model pull smollm2-135m-instruct" in capsys.readouterr().err
