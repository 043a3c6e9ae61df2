"""``pip install .`` without ``--no-build-isolation`` compiles the C++ kernels at install, so no start builds them.

Slow (a fresh environment and a kernel build each, ~3 min apiece on 2 cores): ``pytest -m slow``. Each installs
from a copy of the working tree's tracked files, one instruction-set variant only (``KVRELAY_BUILD_VARIANTS``,
this CPU's), and torch from the same requirement the Makefile uses on a CPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CPU_TORCH = "torch==2.13.0"


def _copy_tree(into: Path) -> Path:
    """The working tree's tracked files (edits included) at ``into``: what a clone of this change would hold."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
    packed = subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=ROOT, input=files, check=True,
                            capture_output=True).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=packed, check=True)
    return into


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(KVRELAY_BUILD_VARIANTS="native", KVRELAY_KERNEL_CACHE=str(tmp / "kernel-cache"), **extra)
    return env


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin"


LOAD = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from kvrelay.kernels.cpu_build import CPU_KERNELS\n"
        "print('origin', CPU_KERNELS.origin if CPU_KERNELS.load() is not None else None)\n")


def test_an_isolated_install_builds_against_the_torch_already_installed(tmp_path: Path) -> None:
    src, env = _copy_tree(tmp_path / "src"), _env(tmp_path)
    bin_dir = _venv(tmp_path / "venv")
    subprocess.run([bin_dir / "pip", "install", "-q", CPU_TORCH], check=True, env=env)
    # --no-deps: only the build is under test; the kernels' loader needs nothing but torch
    subprocess.run([bin_dir / "pip", "install", "-q", "--no-deps", "."], cwd=src, check=True, env=env)
    done = subprocess.run([bin_dir / "python", "-c", LOAD], cwd=tmp_path, capture_output=True, text=True, env=env,
                          check=True)
    assert done.stdout.splitlines()[-1] == "origin prebuilt", done.stdout + done.stderr
    assert not (tmp_path / "kernel-cache").exists()  # nothing was built at load


def test_an_environment_without_torch_gets_it_for_the_build_and_the_wheel_carries_the_kernels(tmp_path: Path) -> None:
    src = _copy_tree(tmp_path / "src")
    constraint = tmp_path / "constraint.txt"
    constraint.write_text(CPU_TORCH + "\n")  # the CPU build, on disk here, for the build environment
    env = _env(tmp_path, PIP_CONSTRAINT=str(constraint))
    bin_dir = _venv(tmp_path / "venv")
    done = subprocess.run([bin_dir / "python", "-c", "import torch"], capture_output=True, env=env)
    assert done.returncode == 1  # the target really has no torch
    subprocess.run([bin_dir / "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), "."], cwd=src,
                   check=True, env=env)
    (wheel,) = (tmp_path / "dist").glob("kvrelay-*.whl")
    with zipfile.ZipFile(wheel) as z:
        kernels = sorted(n for n in z.namelist() if n.startswith("kvrelay/kernels/_cpu_kernels_") and n.endswith(".so"))
    assert len(kernels) == 1, kernels
