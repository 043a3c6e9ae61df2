"""A request's generation deadline (``router.request_timeout_s``), counted from its placement.

A request's life in the router has two bounded parts::

    admitted ── waits in the queue (router.queue_timeout_s; past it: 429 + Retry-After,
        │        before any node did any work for it)
        ▼
    placed (every prompt of it) ── prefill, pull, decode (router.request_timeout_s; past it: 504)

The wait does not count against the generation deadline: a request placed late gets its whole
``request_timeout_s`` to run, so no prompt is prefilled only to be cut off by a deadline its wait used
up (issue 65 item 4: with both at 300 s, a request placed after a 290 s wait was prefilled, streamed
for 10 s and then got a 504). A request lives at most ``queue_timeout_s + request_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from kvrelay.router.openai_api import ApiError
from kvrelay.router.queue import Ticket

T = TypeVar("T")


async def with_deadline(gen: AsyncIterator[T], timeout_s: float, *, tickets: Sequence[Ticket]) -> AsyncIterator[T]:
    """Items of ``gen`` until it ends. Raises ApiError(504) once ``timeout_s`` seconds have passed since every
    one of ``tickets`` was placed (`router.queue.RouterQueue.place`; a ticket the queue gave up on counts as
    placed: its run ends on its own). Only the wait for ``gen``'s next item is bounded, never the caller's
    work between items."""
    loop = asyncio.get_running_loop()
    deadline: float | None = None  # loop time; None until every ticket is placed
    current: asyncio.Timeout | None = None  # the bound on the wait for the next item, while one is awaited

    def arm(_: object = None) -> None:
        nonlocal deadline
        if deadline is None and all(t.placed.done() for t in tickets):
            deadline = loop.time() + timeout_s
            if current is not None:
                current.reschedule(deadline)

    for ticket in tickets:
        ticket.placed.add_done_callback(arm)
    arm()
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline) as current:
                    item = await gen.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                if current is None or not current.expired():
                    raise  # the run's own, not this deadline
                raise ApiError(504, f"the request did not finish within {timeout_s:g} s of its placement "
                                    "(router.request_timeout_s)") from None
            finally:
                current = None
            yield item
    finally:
        for ticket in tickets:
            ticket.placed.remove_done_callback(arm)
