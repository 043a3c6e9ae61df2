"""`kvrelay bench guard --from-json`: a saved run judged against a records file and recorded into it, without
starting a server (the measuring part runs in ``make bench-guard``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvrelay.benchmarks.guard_bench import main
from kvrelay.benchmarks.guard_record import GuardRecord, read_records

CPU = {"model_name": "AMD EPYC", "family": "25", "model": "17", "bf16_flags": ["avx512_bf16"]}
KEY = "AMD EPYC (family 25, model 17; avx512_bf16)"
DOC = "# Benchmarks\n\nProse.\n\n### Regression guard records\n\n```json\n{}\n```\n\n## After\n\nMore prose.\n"


def _saved_run(path: Path, *, kvrelay_burst_tok_s: float, failed: int = 0, busy_cpus: float = 0.0) -> Path:
    runs = []
    for layout in ("aggregated", "1p1d"):
        for rnd in (0, 1):
            for server, burst in (("kvrelay", kvrelay_burst_tok_s), ("vllm", 100.0)):
                runs.append({"layout": layout, "round": rnd, "server": server, "workload": "burst",
                             "busy_cpus_before": busy_cpus, "completed": 16,
                             "failed": failed if server == "kvrelay" else 0, "output_throughput": burst,
                             "mean_tpot_ms": 40.0})
                if layout == "aggregated":
                    runs.append({"layout": layout, "round": rnd, "server": server, "workload": "client",
                                 "completed": 64, "failed": 0, "output_throughput": 150.0 if server == "kvrelay"
                                 else 100.0, "mean_tpot_ms": 50.0})
    path.write_text(json.dumps({"cpu": CPU, "commit": "abc1234", "date": "2026-12-07",
                                "model": "smollm2-135m-instruct", "runs": runs}))
    return path


def test_no_record_then_record_then_ok_then_regression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    run = _saved_run(tmp_path / "run.json", kvrelay_burst_tok_s=150.0)
    args = ["--from-json", str(run), "--records", str(doc)]

    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"no record for {KEY!r}" in out and "REGRESSION" not in out
    assert doc.read_text() == DOC

    assert main([*args, "--record"]) == 0
    assert read_records(doc.read_text()) == {KEY: GuardRecord(
        "abc1234", "2026-12-07", "smollm2-135m-instruct",
        ratios={"client_output_throughput": 1.5, "client_mean_tpot": 1.0, "burst_output_throughput_aggregated": 1.5,
                "burst_output_throughput_1p1d": 1.5},
        spreads={"client_output_throughput": 0.0, "client_mean_tpot": 0.0, "burst_output_throughput_aggregated": 0.0,
                 "burst_output_throughput_1p1d": 0.0})}
    text = doc.read_text()
    assert text.startswith(DOC.split("```json")[0]) and text.endswith("```\n\n## After\n\nMore prose.\n")
    capsys.readouterr()

    assert main(args) == 0
    assert "REGRESSION" not in capsys.readouterr().out

    slower = _saved_run(tmp_path / "slower.json", kvrelay_burst_tok_s=120.0)  # 1.2 against 1.5: 20% down
    assert main(["--from-json", str(slower), "--records", str(doc)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("REGRESSION")]
    assert lines == [
        "REGRESSION: burst, aggregated, out tok/s: kvrelay / vLLM 1.200 against 1.500 recorded (-20.0%, beyond the "
        "15% noise margin)",
        "REGRESSION: burst, 1P1D, out tok/s: kvrelay / vLLM 1.200 against 1.500 recorded (-20.0%, beyond the 15% "
        "noise margin)"]


def test_a_failed_kvrelay_request_fails_the_guard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    run = _saved_run(tmp_path / "run.json", kvrelay_burst_tok_s=150.0, failed=1)
    assert main(["--from-json", str(run), "--records", str(doc)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("REGRESSION")]
    assert lines[0] == "REGRESSION: kvrelay failed 1 requests (aggregated burst, round 0)" and len(lines) == 4


def test_a_records_file_without_the_block_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    run = _saved_run(tmp_path / "run.json", kvrelay_burst_tok_s=150.0)
    with pytest.raises(SystemExit) as exc:
        main(["--from-json", str(run), "--records", str(doc)])
    assert exc.value.code == 2
    assert "no '### Regression guard records' heading" in capsys.readouterr().err


def test_a_run_on_a_busy_machine_is_flagged_and_not_recorded(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    run = _saved_run(tmp_path / "run.json", kvrelay_burst_tok_s=150.0, busy_cpus=0.94)
    assert main(["--from-json", str(run), "--records", str(doc)]) == 0
    out = capsys.readouterr().out
    assert "machine: other work kept up to 0.94 CPUs busy just before a run (limit 0.5)" in out
    assert "WARNING: the machine was not quiet (0.94 CPUs of other work before a run)" in out
    assert main(["--from-json", str(run), "--records", str(doc), "--record"]) == 2
    assert "not recorded: other work kept 0.94 CPUs busy (limit 0.5)" in capsys.readouterr().out
    assert doc.read_text() == DOC
