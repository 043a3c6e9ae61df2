"""`LeaseKeeper`: the reader's side of a lease — renew it while a READ runs, and know until when the
owner surely held it.

::

    start ──renew──▶ owner answers ttl ──▶ valid_until = (time the renew was sent) + ttl
      │   every ttl/3: renew again (each one bounded by renew_timeout_s; a timeout just retries)
      │   owner answers 404 (lease gone)       ──▶ failure = TransferError("lease_lost")
      │   owner answers 409 (another binding)  ──▶ failure = TransferError("bad_handle")
      └── owner unreachable (refused/dropped)  ──▶ failure = TransferError("peer_gone")

Every renew names the handle's binding (`transfer.handle`), so any answered renew also confirms that the
owner leased exactly the handle's blocks and digests for its keys (`wait_confirmed`).

The owner sets expiry = (its now) + ttl after it received the renew, and a lease never comes back once
gone, so ``valid_until`` is a lower bound on the lease's life on any common time axis: a READ that
completed before it read pinned bytes.
"""

from __future__ import annotations

import asyncio
import math

from kvrelay.transfer.errors import TransferError
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.peer_cache import PeerCache


class LeaseKeeper:
    """Renews a handle's lease while its READ runs and knows until when the lease is surely held."""

    def __init__(self, peers: PeerCache, handle: KvHandle, *, renew_timeout_s: float) -> None:
        self._peers = peers
        self._handle = handle
        self._renew_timeout_s = renew_timeout_s
        self.valid_until = -math.inf  # loop time before which the owner surely held the lease
        self.failure: TransferError | None = None
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self._handle.lease_ttl_s / 3
        while True:
            sent = loop.time()
            try:
                ttl = await self._peers.renew(self._handle, timeout_s=min(self._renew_timeout_s, interval))
            except TransferError as exc:
                if exc.reason != "timeout":
                    self._fail(exc)
                    return
                self._changed.set()
                continue
            if ttl is None:
                self._fail(TransferError("lease_lost", f"owner {self._handle.owner_agent!r} no longer holds lease "
                                         f"{self._handle.lease_id} (expired or released)"))
                return
            # The owner set expiry = (its now) + ttl after `sent`, and leases never come back.
            self.valid_until = max(self.valid_until, sent + ttl)
            self._changed.set()
            await asyncio.sleep(interval)

    def _fail(self, exc: TransferError) -> None:
        self.failure = exc
        self._changed.set()

    async def wait_confirmed(self, t_end: float) -> None:
        """Return once the owner has answered a renew (the lease is live, and was granted for exactly this
        handle's keys, blocks and digests). Raises TransferError (``bad_handle`` for another binding)."""
        await self.wait_covers(asyncio.get_running_loop().time(), t_end)

    async def wait_covers(self, t: float, t_end: float) -> None:
        """Return once the lease is known to have been held at loop time ``t``. Raises TransferError."""
        loop = asyncio.get_running_loop()
        while self.valid_until < t:
            self._changed.clear()
            if self.failure is not None:
                raise self.failure
            remaining = t_end - loop.time()
            if remaining <= 0:
                raise TransferError("timeout", f"could not confirm lease {self._handle.lease_id} with "
                                    f"{self._handle.owner_agent!r} before the deadline")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self._task.cancel()
