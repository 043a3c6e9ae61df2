"""Test-side hangs for real node processes: on the PYTHONPATH of a `Cluster`'s env (the product has no such
knob). With ``KVRELAY_TEST_HANG_DIR`` set, the engine node started with ``--name NAME``:

* before an engine step, finds ``DIR/NAME.hang`` (its text: seconds), renames it to ``NAME.hanging`` (the
  test's sign that the hang began) and sleeps that long on the engine thread, then steps: the engine thread
  hangs as in a stuck NIXL call or a CPU lock never given back;
* when its puller has reserved blocks for a pull (on the engine thread), finds ``DIR/NAME.hang-after-reserve``
  and renames it to ``NAME.hang``: the next step hangs, with the pull's later pool calls queued behind it.
* while ``DIR/NAME.step-delay`` exists (its text: seconds), sleeps that long before every engine step: a slow
  model, so that a long stream stays long whatever the machine;
* when a KV pull has reserved its blocks and issued its READs, finds ``DIR/NAME.pull-delay`` (its text: seconds),
  renames it to ``NAME.pull-delaying`` and waits that long (on the event loop) before waiting for the READs: a
  pull in flight, its blocks reserved here and its lease held on the prefill node, for as long as a test needs.

* (issue 65) before a forward, finds ``DIR/NAME.poison`` (JSON ``{"prefix": [ids], "after_tokens": k}``) and
  raises IndexError if the step runs a sequence whose prompt starts with ``prefix`` and that has at least ``k``
  output tokens: one request that fails every step it is in, as an out-of-range index in a kernel would;
* (issue 65) a decode node that finds ``DIR/NAME.cut-after-writes`` (its text: N) when it writes to a stream
  renames it to ``NAME.cut`` and makes that stream's N-th write time out as a write to a router that stopped
  reading does (`transfer.bounded_write.write_within`: the connection aborted, False): the node's own cut of a
  stalled reader, without filling the megabytes of loopback socket buffers first (`kvrelay config check` keeps
  ``decode.write_stall_timeout_s`` above the router's, so a test cannot make the router stall first).

The patches go in when ``engine.engine`` / ``transfer.puller`` are first imported, not before (a node sets
its environment up first; the router and ``kvrelay up`` never import them).
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path


def _trigger(name: str) -> Path | None:
    argv = sys.argv
    if "--name" not in argv:
        return None
    return Path(os.environ["KVRELAY_TEST_HANG_DIR"]) / f"{argv[argv.index('--name') + 1]}.{name}"


def _patch_engine(module) -> None:
    step = module.LLMEngine.step

    def hanging_step(self):
        delay = _trigger("step-delay")
        if delay is not None and delay.exists():
            time.sleep(float(delay.read_text()))
        trigger = _trigger("hang")
        if trigger is not None and trigger.exists():
            seconds = float(trigger.read_text())
            trigger.rename(trigger.with_suffix(".hanging"))
            time.sleep(seconds)
        return step(self)

    module.LLMEngine.step = hanging_step


def _patch_puller(module) -> None:
    reserve = module.Puller._reserve

    def arming_reserve(self, keys):
        res = reserve(self, keys)
        trigger = _trigger("hang-after-reserve")
        if trigger is not None and trigger.exists():
            trigger.rename(trigger.with_suffix(".hang"))
        return res

    module.Puller._reserve = arming_reserve
    wait = module.Puller._wait

    async def delayed_wait(self, xfers, handle, keeper, t_end):
        trigger = _trigger("pull-delay")
        if trigger is not None and trigger.exists():
            seconds = float(trigger.read_text())
            trigger.rename(trigger.with_suffix(".pull-delaying"))
            await asyncio.sleep(seconds)
        return await wait(self, xfers, handle, keeper, t_end)

    module.Puller._wait = delayed_wait


def _patch_runner(module) -> None:
    run = module.ModelRunner.run

    def poisoned_run(self, step, **kwargs):
        trigger = _trigger("poison")
        if trigger is not None and trigger.exists():
            spec = json.loads(trigger.read_text())
            prefix, after = spec["prefix"], spec["after_tokens"]
            for seq in [c.seq for c in step.prefills] + list(step.decodes):
                if seq.token_ids[:len(prefix)] == prefix and seq.num_output_tokens >= after:
                    raise IndexError("index 4242 is out of bounds for dimension 0 with size 258")
        return run(self, step, **kwargs)

    module.ModelRunner.run = poisoned_run


def _patch_decode_service(module) -> None:
    write_within = module.write_within
    writes: dict[int, int] = {}  # id(request) of the stream being cut -> its writes so far

    async def cutting_write_within(request, resp, data=b"", *, eof=False, timeout_s):
        trigger = _trigger("cut-after-writes")
        if trigger is not None and trigger.exists() and not writes:
            writes[id(request)] = int(trigger.read_text()) - 1
            trigger.rename(trigger.with_suffix(".cut"))
        left = writes.get(id(request))
        if left is not None:
            writes[id(request)] = left - 1
            if left == 0:  # what write_within does when a write does not finish in time
                request.transport.abort()
                return False
        return await write_within(request, resp, data, eof=eof, timeout_s=timeout_s)

    module.write_within = cutting_write_within


PATCHES = {"kvrelay.engine.engine": _patch_engine, "kvrelay.transfer.puller": _patch_puller,
           "kvrelay.engine.model_runner": _patch_runner, "kvrelay.decode.service": _patch_decode_service}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._finding: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, PATCHES[fullname]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = Loader()
        return spec


if os.environ.get("KVRELAY_TEST_HANG_DIR") and "--name" in sys.argv:
    sys.meta_path.insert(0, _PatchAfterImport())
