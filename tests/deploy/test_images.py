"""Issue 14: the container images' recipes (no Docker daemon here to build them): every package the
project installs is copied in, the process runs as a non-root user, `kvrelay` is the entry point and
the model directory is a volume."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_recipe(name):
    text = (ROOT / name).read_text()
    # the folders pyproject.toml maps under kvrelay ("kvrelay.engine" = "engine"), and kvrelay/ itself
    mapped = re.findall(r'^"kvrelay\.\w+" = "(\w+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    packages = sorted([*mapped, "kvrelay"])
    assert len(packages) >= 10
    copied = sorted(re.findall(r"^COPY (\w+)/ \1/$", text, flags=re.M))
    assert copied == packages
    assert re.search(r"^COPY pyproject.toml README.md ./$", text, flags=re.M)
    users = re.findall(r"^USER (\S+)$", text, flags=re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["kvrelay"\]$', text, flags=re.M)
    assert re.search(r'^VOLUME \["/models"\]$', text, flags=re.M)
