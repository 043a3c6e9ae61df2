"""`kvrelay bench transfer` runs end to end on a small configuration and reports every section."""

from __future__ import annotations

import json

import pytest
from kvrelay.benchmarks import transfer_bench


@pytest.mark.slow
def test_transfer_bench_reports_reads_scaling_and_demotion(capsys, tmp_path):
    assert transfer_bench.main(["--pool-mib", "16", "--target-mib", "4", "--out", str(tmp_path / "t.json")]) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert '"bench": "transfer"' in capsys.readouterr().out
    sizes = {(r["block_bytes"], r["blocks_per_transfer"]) for r in result["read"]}
    assert (64 * 1024, 1) in sizes and (4 << 20, 4) in sizes
    assert all(r["read_gbps"] > 0 and r["memcpy_gbps"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in result["read"])
    assert result["descriptor_scaling"]["points"][0]["descriptors"] == 1
    assert all(r["digest_gbps"] > 0 and r["digest_fraction_of_read"] > 0 for r in result["read"])
    integrity = result["integrity"]
    assert integrity["max_fraction_any"] == max(r["digest_fraction_of_read"] for r in result["read"])
    assert integrity["met"] == (integrity["max_fraction_judged"] is not None
                                and integrity["max_fraction_judged"] <= integrity["max_fraction_goal"])
    assert {r["block_bytes"] for r in result["loopback_demotion"]} == {256 * 1024, 2 << 20}


def test_remote_transfer_bench_reads_between_two_hosts_and_measures_raw_tcp(tmp_path):
    """``--remote``: READs between two network namespaces over UCX/TCP, every configuration moved and
    timed, beside a raw TCP stream between the same hosts (the namespaces are gone afterwards)."""
    import subprocess
    import sys

    from kvrelay.benchmarks.netns import netns_problem
    from kvrelay.benchmarks.transfer_remote import CONFIGS

    problem = netns_problem()
    if problem is not None:
        pytest.skip(f"--remote needs network namespaces: {problem}")
    # Its own process, as a user runs it: the bench points UCX at its hosts' interfaces (environment).
    done = subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", "bench", "transfer", "--remote",
                           "--pool-mib", "64",
                           "--target-mib", "8", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["bench"] == "transfer-remote" and len(result["raw_tcp_gbps"]) == 6
    assert sorted((r["block_bytes"], r["blocks_per_transfer"]) for r in result["read"]) == sorted(CONFIGS)
    for row in result["read"]:
        assert row["transfers"] >= 5 and row["read_gbps"] > 0
        assert abs(row["ratio_vs_raw_tcp"] - row["read_gbps"] / row["raw_tcp_gbps"]) < 2e-3  # of rounded figures
    assert "kv" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
