"""`benchmarks.guard_record`: per-round ratios from run rows, the judgement against a record, and the record
block of ``docs/benchmarks.md`` read and rewritten."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvrelay.benchmarks.guard_record import (
    FIGURES,
    GuardRecord,
    RatioSummary,
    judge,
    read_records,
    summarize_runs,
    write_record,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
ZEN4 = "AMD EPYC (family 25, model 17; avx512_bf16)"

HEAD = """# Benchmarks

Prose, and another JSON block that is not the record:

```json
{"not": "a record"}
```

### Regression guard records

What the block holds.

"""
TAIL = """
## Later section

```
kvrelay bench guard
```
"""
BLOCK = """```json
{
  "AMD EPYC (family 23, model 1; no bf16)": {
    "commit": "1111111",
    "date": "2026-12-06",
    "model": "smollm2-135m-instruct",
    "ratios": {"client_output_throughput": 1.9},
    "spreads": {"client_output_throughput": 0.05}
  }
}
```
"""
ZEN1_RECORD = GuardRecord("1111111", "2026-12-06", "smollm2-135m-instruct", ratios={"client_output_throughput": 1.9},
                          spreads={"client_output_throughput": 0.05})


def _row(layout: str, rnd: int, server: str, workload: str, tok_s: float, tpot_ms: float) -> dict[str, object]:
    return {"layout": layout, "round": rnd, "server": server, "workload": workload, "completed": 16, "failed": 0,
            "output_throughput": tok_s, "mean_tpot_ms": tpot_ms}


def test_ratios_pair_kvrelay_and_vllm_of_the_same_round_layout_and_workload() -> None:
    runs = [
        _row("aggregated", 0, "kvrelay", "client", 200.0, 40.0), _row("aggregated", 0, "vllm", "client", 100.0, 50.0),
        _row("aggregated", 1, "vllm", "client", 100.0, 40.0), _row("aggregated", 1, "kvrelay", "client", 150.0, 50.0),
        _row("aggregated", 0, "kvrelay", "burst", 300.0, 10.0), _row("aggregated", 0, "vllm", "burst", 200.0, 10.0),
        _row("1p1d", 0, "kvrelay", "burst", 90.0, 10.0), _row("1p1d", 0, "vllm", "burst", 100.0, 10.0),
        _row("1p1d", 1, "kvrelay", "burst", 75.0, 10.0),  # vLLM's run of round 1 is missing: no ratio
    ]
    assert summarize_runs(runs) == {
        "client_output_throughput": RatioSummary((2.0, 1.5)),
        "client_mean_tpot": RatioSummary((0.8, 1.25)),
        "burst_output_throughput_aggregated": RatioSummary((1.5,)),
        "burst_output_throughput_1p1d": RatioSummary((0.9,)),
    }
    assert summarize_runs(runs[:4]).keys() == {"client_output_throughput", "client_mean_tpot"}


def test_median_and_spread_of_rounds() -> None:
    assert RatioSummary((1.25, 0.75, 1.0)).median == 1.0
    assert RatioSummary((1.25, 0.75, 1.0)).spread == 0.5
    assert RatioSummary((1.5,)).spread == 0.0
    assert RatioSummary((0.0, 0.0)).spread == 0.0


def test_judge_flags_what_moved_the_wrong_way_past_the_margin() -> None:
    record = GuardRecord("abc", "2026-12-07", "m",
                         ratios={"client_output_throughput": 1.0, "client_mean_tpot": 1.0,
                                 "burst_output_throughput_aggregated": 2.0},
                         spreads={"burst_output_throughput_aggregated": 0.5})
    fresh = {
        "client_output_throughput": RatioSummary((0.75, 0.75)),  # 25% down, margin 15%: regressed
        "client_mean_tpot": RatioSummary((1.25,)),  # TPOT 25% up (lower is better): regressed
        "burst_output_throughput_aggregated": RatioSummary((1.5, 1.5)),  # 25% down; margin (0 + 0.5) / 2
        "burst_output_throughput_1p1d": RatioSummary((0.75, 1.0, 1.25)),  # not in the record; margin 0.5 / 2
    }
    verdicts = judge(fresh, record)
    assert [v.figure.name for v in verdicts] == [f.name for f in FIGURES]
    assert [v.figure.name for v in verdicts if v.regressed] == ["client_output_throughput", "client_mean_tpot"]
    assert [v.margin_frac for v in verdicts] == [0.15, 0.15, 0.25, 0.25]
    assert [v.recorded for v in verdicts] == [1.0, 1.0, 2.0, None]
    assert [v.worse_frac for v in verdicts][2:] == [0.25, None]
    # Better is never a regression, in either direction of "better".
    better = judge({"client_output_throughput": RatioSummary((1.5,)), "client_mean_tpot": RatioSummary((0.5,))},
                   record)
    assert [(v.worse_frac, v.regressed) for v in better] == [(-0.5, False), (-0.5, False)]
    # A fresh run's own spread widens its margin, by half: 0.75 with rounds 0.5 and 1.0 (spread 2/3) is 25% down
    # against a margin of 1/3; a wild run far down is still flagged (0.3: spread 1.33, margin 0.67, 70% down).
    assert judge({"client_output_throughput": RatioSummary((0.5, 1.0))}, record)[0].regressed is False
    assert judge({"client_output_throughput": RatioSummary((0.1, 0.3, 0.5))}, record)[0].regressed is True
    assert [v.regressed for v in judge(fresh, None)] == [False, False, False, False]


def test_read_records_from_markdown() -> None:
    assert read_records(HEAD + BLOCK + TAIL) == {"AMD EPYC (family 23, model 1; no bf16)": ZEN1_RECORD}
    assert read_records(HEAD + "```json\n{}\n```\n" + TAIL) == {}
    with pytest.raises(ValueError, match="no '### Regression guard records' heading"):
        read_records("# Benchmarks\n\n```json\n{}\n```\n")
    with pytest.raises(ValueError, match="no closed ```json block under"):
        read_records(HEAD + "```json\n{}\n")
    with pytest.raises(ValueError, match="is not a JSON object of guard records"):
        read_records(HEAD + '```json\n{"cpu": {"ratios": {}}}\n```\n')


def test_write_record_changes_only_the_block() -> None:
    fresh = GuardRecord("2222222", "2026-12-07", "smollm2-135m-instruct",
                        ratios={"client_output_throughput": 0.97}, spreads={"client_output_throughput": 0.02})
    out = write_record(HEAD + BLOCK + TAIL, ZEN4, fresh)
    assert out == HEAD + """```json
{
  "AMD EPYC (family 23, model 1; no bf16)": {
    "commit": "1111111",
    "date": "2026-12-06",
    "model": "smollm2-135m-instruct",
    "ratios": {
      "client_output_throughput": 1.9
    },
    "spreads": {
      "client_output_throughput": 0.05
    }
  },
  "AMD EPYC (family 25, model 17; avx512_bf16)": {
    "commit": "2222222",
    "date": "2026-12-07",
    "model": "smollm2-135m-instruct",
    "ratios": {
      "client_output_throughput": 0.97
    },
    "spreads": {
      "client_output_throughput": 0.02
    }
  }
}
```
""" + TAIL
    assert read_records(out) == {"AMD EPYC (family 23, model 1; no bf16)": ZEN1_RECORD, ZEN4: fresh}
    # Writing the same CPU again replaces its record; CRLF files keep their line endings.
    again = GuardRecord("3333333", "2026-12-08", "m")
    assert read_records(write_record(out, ZEN4, again))[ZEN4] == again
    crlf = (HEAD + BLOCK + TAIL).replace("\n", "\r\n")
    assert "\n" not in write_record(crlf, ZEN4, again).replace("\r\n", "")


def test_the_shipped_record_block_reads_and_rewrites_in_place() -> None:
    text = DOCS.read_text()
    records = read_records(text)
    assert all(isinstance(r, GuardRecord) and set(r.ratios) <= {f.name for f in FIGURES} for r in records.values())
    test_cpu, test_record = "Test CPU (family 0, model 0; no bf16)", GuardRecord("x", "2026-01-01", "m")
    out = write_record(text, test_cpu, test_record)
    before, after = text.splitlines(), out.splitlines()
    opening = before.index("```json", before.index("### Regression guard records"))
    end_before, end_after = before.index("```", opening), after.index("```", opening)
    assert after[: opening + 1] == before[: opening + 1] and after[end_after:] == before[end_before:]
    assert read_records(out) == {**records, test_cpu: test_record}
