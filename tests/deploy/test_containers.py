"""Issue 64: kvrelay's image, built and run with podman, answers a chat request from the host exactly as kvrelay
outside a container does: one all-in-one container (``kvrelay up --host 0.0.0.0``) and 1P1D as three containers on
one network. ``make container-check`` in one test (slow: it builds the images; ~10 min the first time)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_model import RealModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (apt-get install podman buildah "
                                                            "debootstrap runc)")
def test_container_check_answers_exactly_in_both_layouts(smollm2: RealModel, tmp_path: Path) -> None:
    out = tmp_path / "container-check.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "container_check.py"), "--model",
                             str(smollm2.model_dir), "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=3300)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the check removes its containers before it exits
        proc.communicate(timeout=120)
        raise
    assert proc.returncode == 0, stdout[-4000:] + stderr[-8000:]
    summary = json.loads(out.read_text())
    want = summary["reference"]
    assert want["token_ids"] and want["text"]
    for layout in ("all_in_one", "1p1d"):
        assert summary[layout]["exact"], summary[layout]
        assert summary[layout]["text"] == want["text"]
    plans = summary["1p1d"]["router_plans"]  # prefilled in the prefill container, the KV pulled by the decode one
    assert plans.get("disaggregated", 0) >= 1 and not plans.get("local"), plans
    leftover = subprocess.run(["podman", "ps", "-a", "--filter", "name=^kvrelay-check-", "--format", "{{.Names}}"],
                              capture_output=True, text=True, check=True).stdout
    assert leftover == ""
