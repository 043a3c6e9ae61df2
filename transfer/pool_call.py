"""`PoolCalls`: where the transfer layer runs `BlockPool` and `LeaseTable` mutations.

Only one thread may touch a pool (the engine's worker thread in a service). The transfer layer runs
on the event loop, so every pool operation it makes goes through a ``PoolCall``: an async function
that runs a zero-argument callable where the pool lives and returns its result (or raises its error).
There are two, by what the callable does (`PoolCalls`):

* ``call`` — takes blocks or only reads (reserve blocks for a pull, renew a lease): skipped if its caller
  stopped waiting before it started, so nothing is taken for nobody (`EngineWorker.call`).
* ``must_run`` — gives blocks back (release a lease or blocks, key the blocks a pull read): runs once,
  in queue order, even after its caller stopped waiting; skipped, the blocks would be lost for good
  (`EngineWorker.must_run`).

`INLINE` runs both right here — for a pool that the event loop thread owns (tests, benchmarks).
A service's are `transfer.node_agent.worker_pool_calls`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
PoolCall = Callable[[Callable[[], Any]], Awaitable[Any]]


async def run_inline(fn: Callable[[], T]) -> T:
    """Run ``fn()`` on the calling (event loop) thread."""
    return fn()


@dataclass(frozen=True, slots=True)
class PoolCalls:
    """The two ways to run a pool operation where the pool lives (see the module docstring)."""

    call: PoolCall = run_inline  # may be skipped once its caller stopped waiting: takes blocks, reads
    must_run: PoolCall = run_inline  # never skipped: gives blocks back


INLINE = PoolCalls()
