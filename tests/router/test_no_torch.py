"""The router is a torch-free process part: importing every router module loads neither torch nor numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "local.yaml"


def test_importing_the_router_loads_no_torch() -> None:
    code = ("import importlib, pkgutil, sys, router\n"
            "names = [m.name for m in pkgutil.iter_modules(router.__path__)]\n"
            "for name in names: importlib.import_module('router.' + name)\n"
            "print(len(names), sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert int(out[0]) >= 7 and out[1].strip() == "[]"


def test_the_router_process_loads_no_torch(tiny_model_dir) -> None:
    """What `kvrelay router` runs: the command, the config, and the router's app, built for real."""
    code = ("import sys\n"
            "from kvrelay.deploy.cli import build_parser\n"
            f"args = build_parser().parse_args(['router', '--config', {str(CONFIG)!r}])\n"
            "from kvrelay.deploy.config import load_config\n"
            "from kvrelay.deploy.serve import build_app\n"
            f"config = load_config({str(CONFIG)!r}, model_path={str(tiny_model_dir)!r})\n"
            "app, host, port = build_app(config, 'router', 0)\n"
            "print(port, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert out[0] == "8000" and out[1].strip() == "[]"
