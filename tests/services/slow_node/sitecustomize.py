"""Test-side: put on PYTHONPATH (`Cluster(env=...)`) to slow one node's engine.

``KVRELAY_TEST_SLOW_NODE=NAME:SECONDS[:LOG]``: the process started with ``--name NAME`` sleeps SECONDS before
every engine step (`engine.engine.LLMEngine.step`), and appends a line to LOG (if given) for each. Every other
process is left alone (nothing is imported here unless the name matches: the router loads no torch).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

_SPEC = os.environ.get("KVRELAY_TEST_SLOW_NODE", "")


def _patch(module: object, delay_s: float, log_path: str | None) -> None:
    engine_cls = module.LLMEngine  # type: ignore[attr-defined]
    step = engine_cls.step

    def slow_step(self: object) -> object:
        time.sleep(delay_s)
        if log_path:
            with open(log_path, "a") as f:
                f.write("step\n")
        return step(self)

    engine_cls.step = slow_step


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps ``engine.engine``'s loader so that the class is patched right after the module runs."""

    def __init__(self, delay_s: float, log_path: str | None) -> None:
        self.delay_s, self.log_path = delay_s, log_path

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != "kvrelay.engine.engine":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, finder = spec.loader, self

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):  # noqa: ANN001, ANN201
                return loader.create_module(spec)

            def exec_module(self, module):  # noqa: ANN001, ANN201
                loader.exec_module(module)
                _patch(module, finder.delay_s, finder.log_path)

        spec.loader = Loader()
        return spec


if _SPEC:
    _name, _delay, *_log = _SPEC.split(":", 2)
    _argv = list(getattr(sys, "orig_argv", sys.argv))
    if "--name" in _argv and _argv.index("--name") + 1 < len(_argv) and _argv[_argv.index("--name") + 1] == _name:
        sys.meta_path.insert(0, _Finder(float(_delay), _log[0] if _log else None))

# The shared test hooks too (only one sitecustomize is imported per process): publish faults, held pulls.
import runpy  # noqa: E402

runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "hooks", "sitecustomize.py"))
