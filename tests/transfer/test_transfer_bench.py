"""`kvrelay bench transfer` runs end to end on a small configuration and reports every section."""

from __future__ import annotations

import json

import pytest

from benchmarks import transfer_bench


@pytest.mark.slow
def test_transfer_bench_reports_reads_scaling_and_demotion(capsys, tmp_path):
    assert transfer_bench.main(["--pool-mib", "16", "--target-mib", "4", "--out", str(tmp_path / "t.json")]) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert '"bench": "transfer"' in capsys.readouterr().out
    sizes = {(r["block_bytes"], r["blocks_per_transfer"]) for r in result["read"]}
    assert (64 * 1024, 1) in sizes and (4 << 20, 4) in sizes
    assert all(r["read_gbps"] > 0 and r["memcpy_gbps"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in result["read"])
    assert result["descriptor_scaling"]["points"][0]["descriptors"] == 1
    assert {r["block_bytes"] for r in result["loopback_demotion"]} == {256 * 1024, 2 << 20}
