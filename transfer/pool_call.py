"""`PoolCall`: where the transfer layer runs `BlockPool` and `LeaseTable` mutations.

Only one thread may touch a pool (the engine's worker thread in a service). The transfer layer runs
on the event loop, so every pool operation it makes goes through a ``PoolCall``: an async function
that runs a zero-argument callable where the pool lives and returns its result (or raises its error).

* `run_inline` runs it right here — for a pool that the event loop thread owns (tests, benchmarks).
* A service passes e.g. ``lambda fn: worker.call(lambda _engine: fn())`` (`EngineWorker.call`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
PoolCall = Callable[[Callable[[], Any]], Awaitable[Any]]


async def run_inline(fn: Callable[[], T]) -> T:
    """Run ``fn()`` on the calling (event loop) thread."""
    return fn()
