"""``kvrelay bench install``: a vLLM user's install-to-first-answer, against ``make serve`` at an older commit.

Two paths, each from a clean copy of its commit in a fresh directory, run one after the other:

* ``pip``: the package path the README shows. A fresh virtual environment, pip upgraded; torch first
  (``--torch``, the CPU build where it lies on disk here); ``pip install .`` (an isolated build, compiling the C++
  kernels' instruction-set variant this CPU runs, `setup.py`); ``kvrelay model pull``; ``kvrelay serve DIR``.
* ``make``: ``make serve`` at ``--baseline`` (default 023e823, the commit issue 64 measured), which creates its own
  environment, pulls the model and starts router, prefill and decode.

Each is timed from its first command to the first chat completion answered with 200 (greedy, 8 tokens), then its
processes are stopped. Both get a fresh C++ kernel cache (``TORCH_EXTENSIONS_DIR``, ``KVRELAY_KERNEL_CACHE``), so a
path that compiles at its first start pays for it; pip's own download cache is shared (both install the same
packages from the same indexes). Reported: each path's phases and total seconds, and ``pip_over_make`` (< 1: the
package path is ready sooner). Ports 8000/8100/8200 must be free (the default configs pin them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvrelay.benchmarks.common import emit, machine_label

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
READY_WAIT_S = 900.0


def _export(rev: str, into: Path) -> None:
    """A clean copy of ``rev``'s tracked files (``HEAD`` of this repository by default) at ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> float:
    """Seconds ``cmd`` took; raises CalledProcessError with its output's tail on failure."""
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise subprocess.CalledProcessError(done.returncode, cmd)
    return time.monotonic() - start


def _first_answer(url: str, proc: subprocess.Popen, *, wait_s: float) -> None:
    """Poll ``url`` with a short greedy chat request until it answers 200; raises if ``proc`` exits or time runs
    out."""
    body = json.dumps({"model": MODEL, "temperature": 0, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no answer from {url} within {wait_s:.0f} s")


def _serve_until_answer(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> float:
    """Seconds from starting ``cmd`` to its first chat answer on port 8000; its process group is stopped after.
    Its output goes to ``cwd.parent / "serve.log"``, whose tail is printed when it fails."""
    start = time.monotonic()
    log_path = cwd.parent / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _first_answer("http://127.0.0.1:8000/v1/chat/completions", proc, wait_s=READY_WAIT_S)
        return time.monotonic() - start
    except (RuntimeError, TimeoutError):
        sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if ".venv" not in p)
    env["TORCH_EXTENSIONS_DIR"] = str(work / "torch-extensions")
    env["KVRELAY_KERNEL_CACHE"] = str(work / "kvrelay-kernels")
    return env


def pip_path(work: Path, *, rev: str, torch_req: str, python: str) -> dict:
    src, venv = work / "src", work / "venv"
    _export(rev, src)
    env, phases = _env(work), {}
    start = time.monotonic()
    phases["venv_s"] = _run([python, "-m", "venv", str(venv)], cwd=work, env=env)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    # as the README says, and as `make serve` does: a venv's bundled pip resolves ~2x slower than the current one
    phases["pip_upgrade_s"] = _run([*pip, "--upgrade", "pip"], cwd=work, env=env)
    phases["torch_s"] = _run([*pip, torch_req], cwd=work, env=env)
    phases["pip_install_s"] = _run([*pip, "."], cwd=src, env=env)
    kvrelay = str(venv / "bin" / "kvrelay")
    phases["model_pull_s"] = _run([kvrelay, "model", "pull", MODEL, "--dir", str(work / MODEL)], cwd=work, env=env)
    phases["serve_to_answer_s"] = _serve_until_answer([kvrelay, "serve", str(work / MODEL)], cwd=work, env=env)
    return {**{k: round(v, 1) for k, v in phases.items()}, "total_s": round(time.monotonic() - start, 1)}


def make_path(work: Path, *, rev: str, python: str) -> dict:
    src = work / "src"
    _export(rev, src)
    env = _env(work)
    start = time.monotonic()
    # `make serve` installs, pulls and then serves in the foreground: its first answer ends the clock
    serve = _serve_until_answer(["make", "serve", f"PY={python}"], cwd=src, env=env)
    return {"make_serve_to_answer_s": round(serve, 1), "total_s": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrelay bench install", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the commit whose package path is timed")
    parser.add_argument("--baseline", default="023e823", help="the commit whose `make serve` is timed")
    parser.add_argument("--torch", default="torch==2.13.0", help="the torch requirement installed first")
    parser.add_argument("--python", default="python3", help="the interpreter both environments are made from")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    from kvrelay.model.cpu_identity import this_cpu

    with tempfile.TemporaryDirectory(prefix="kvrelay-install-") as tmp:
        pip = pip_path(Path(tmp) / "pip", rev=args.rev, torch_req=args.torch, python=args.python)
        print(json.dumps({"pip": pip}), file=sys.stderr, flush=True)  # kept should the other path fail
        make = make_path(Path(tmp) / "make", rev=args.baseline, python=args.python)
    emit({"bench": "install", **machine_label(), "cpu": this_cpu().describe(), "rev": args.rev,
          "baseline": args.baseline, "pip": pip, "make": make,
          "pip_over_make": round(pip["total_s"] / make["total_s"], 2)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
