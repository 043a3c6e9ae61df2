"""Test-side slow disk for `kvrelay up`'s nodes (tests/services/test_planned_stop.py): with
``KVRELAY_TEST_SLOW_DISK_S_PER_BLOCK`` set, every commit of the disk tier's writer sleeps that long per
block it puts, as a slow disk would. Patched when ``kvstore.lmdb_writer`` is first imported, so processes
that never load it (the router, ``kvrelay up``) are untouched."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

_DELAY_S = float(os.environ.get("KVRELAY_TEST_SLOW_DISK_S_PER_BLOCK", "0") or 0)
_TARGET = "kvrelay.kvstore.lmdb_writer"


def _patch(module) -> None:
    write = module.LmdbWriter._write

    def slow_write(self, puts, deletes, touched, deltas):
        time.sleep(_DELAY_S * len(puts))
        return write(self, puts, deletes, touched, deltas)

    module.LmdbWriter._write = slow_write


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if _DELAY_S > 0:
    sys.meta_path.insert(0, _Finder())
