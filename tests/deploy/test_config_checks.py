"""Issue 65: ``kvrelay config check`` refuses timeouts out of order (`deploy.config_checks.KEY_ORDERS`), naming both
keys and their values; a Kubernetes grace period too short for the drain and the persist is named the same way."""

from __future__ import annotations

import textwrap

import pytest
from kvrelay.deploy.cli import main
from kvrelay.deploy.config_checks import termination_grace_error


@pytest.mark.parametrize(("section", "message"), [
    ("decode: {write_stall_timeout_s: 5}\nrouter: {write_stall_timeout_s: 600}\n",
     "decode.write_stall_timeout_s (5) must be > router.write_stall_timeout_s (600)"),
    ("decode: {write_stall_timeout_s: 30}\nrouter: {write_stall_timeout_s: 30}\n",
     "decode.write_stall_timeout_s (30) must be > router.write_stall_timeout_s (30)"),
    ("router: {write_stall_timeout_s: 90}\n",  # the decode default, 60
     "decode.write_stall_timeout_s (60) must be > router.write_stall_timeout_s (90)"),
])
def test_config_check_refuses_timeouts_out_of_order_naming_both_keys(tmp_path, capsys, section, message):
    path = tmp_path / "kvrelay.yaml"
    path.write_text("model: {path: m}\n" + section)
    assert main(["config", "check", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"kvrelay config check: {message}: ")


def test_config_check_accepts_timeouts_in_order(tmp_path, capsys):
    path = tmp_path / "kvrelay.yaml"
    path.write_text(textwrap.dedent("""\
        model: {path: m}
        decode: {write_stall_timeout_s: 601}
        router: {write_stall_timeout_s: 600}
        """))
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: ok\n"


def test_a_grace_period_shorter_than_drain_persist_and_margin_is_named():
    assert termination_grace_error(drain_timeout_s=30, persist_timeout_s=80, grace_period_s=120, margin_s=10) is None
    assert termination_grace_error(drain_timeout_s=30, persist_timeout_s=300, grace_period_s=120, margin_s=10) == (
        "terminationGracePeriodSeconds (120) must be >= internal.drain_timeout_s (30) + internal.persist_timeout_s "
        "(300) + 10: the pod is killed before its KV reaches disk")
