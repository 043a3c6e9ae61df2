"""The router is a torch-free process part: importing every router module loads neither torch nor numpy."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_router_loads_no_torch() -> None:
    code = ("import importlib, pkgutil, sys, router\n"
            "names = [m.name for m in pkgutil.iter_modules(router.__path__)]\n"
            "for name in names: importlib.import_module('router.' + name)\n"
            "print(len(names), sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert int(out[0]) >= 7 and out[1].strip() == "[]"
