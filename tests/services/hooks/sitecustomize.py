"""Test-only hooks for node processes started by a test (on ``PYTHONPATH`` through `Cluster`'s ``env``).

``KVRELAY_TEST_HOLD_PULLS=FILE``: while FILE exists, a decode node holds each request that has a KV handle
before its pull begins, and touches ``FILE.seen`` when it holds one (a test then kills the prefill node
that holds the handle's KV, and removes FILE).

``KVRELAY_TEST_SLOW_PULL_S=S``: a decode node's every KV pull that moves blocks takes ``S`` seconds more (a slow
link between prefill and decode nodes).

``KVRELAY_TEST_PUBLISH_FAULTS=F1,F2``: a prefill node injects these `transfer.config.PUBLISH_FAULTS` into what it
publishes (damaged blocks, false handles), to prove readers check what they read. Only this hook sets them: no
configuration key can (`tests.services.cluster.publish_faults` builds the environment).
"""

import os
import sys

_hold = os.environ.get("KVRELAY_TEST_HOLD_PULLS")
if _hold and sys.argv[1:2] == ["decode"]:
    import asyncio

    import kvrelay.decode.service as _service

    _pinned_blocks = _service.DecodeService._pinned_blocks

    async def _held(self, msg, keys):  # type: ignore[no-untyped-def]
        if msg.handle is not None and os.path.exists(_hold):
            open(_hold + ".seen", "w").close()
            while os.path.exists(_hold):
                await asyncio.sleep(0.05)
        return await _pinned_blocks(self, msg, keys)

    _service.DecodeService._pinned_blocks = _held

_slow = float(os.environ.get("KVRELAY_TEST_SLOW_PULL_S", "0"))
if _slow > 0 and sys.argv[1:2] == ["decode"]:
    import asyncio

    import kvrelay.decode.kv_pull as _kv_pull

    _pull = _kv_pull.DecodeTransfer.pull

    async def _slow_pull(self, handle, request_id, *, deadline_s):  # type: ignore[no-untyped-def]
        result = await _pull(self, handle, request_id, deadline_s=deadline_s)
        if result.bytes_read:
            await asyncio.sleep(_slow)
        return result

    _kv_pull.DecodeTransfer.pull = _slow_pull

_faults = tuple(f for f in os.environ.get("KVRELAY_TEST_PUBLISH_FAULTS", "").split(",") if f)
if _faults and sys.argv[1:2] == ["prefill"]:
    import dataclasses

    import kvrelay.prefill.kv_publish as _kv_publish

    _init = _kv_publish.PrefillTransfer.__init__

    def _faulty_init(self, worker, config, *, owner_url):  # type: ignore[no-untyped-def]
        _init(self, worker, dataclasses.replace(config, inject_faults=_faults), owner_url=owner_url)

    _kv_publish.PrefillTransfer.__init__ = _faulty_init
