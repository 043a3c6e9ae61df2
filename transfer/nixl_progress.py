"""`new_nixl_agent`: a NIXL agent whose progress thread sleeps while nothing happens.

NIXL's UCX backend runs one progress thread per agent. It waits in ``poll()`` on the UCX workers'
event descriptors, so a completion, an incoming notification or a peer's request wakes it at once;
the poll timeout (the agent config's ``pthrDelay``, in µs, rounded up to whole ms) is only a safety
net for events ``poll`` misses. `nixl._api.nixl_agent` hard-codes ``pthrDelay = 0``: a zero timeout,
so the thread spins and takes a whole core on an idle node (measured here: 0.98 CPU-seconds per
second per agent; with 10 ms, 0.003).

`new_nixl_agent` builds the agent with a config class whose ``pthrDelay`` keeps our value whatever
the wrapper assigns. The wrapper reads ``nixlBind.nixlAgentConfig`` when it builds the agent, so that
name is swapped for the duration of the constructor only, under a lock.
"""

from __future__ import annotations

import threading
from typing import Any

from nixl import _api as nixl_api

DEFAULT_PROGRESS_POLL_US = 10_000
_SWAP_LOCK = threading.Lock()  # the constructor swaps a module attribute of nixl._api for its duration


def new_nixl_agent(name: str, backends: list[str], *, progress_poll_us: int = DEFAULT_PROGRESS_POLL_US) -> Any:
    """``nixl_agent(name, nixl_agent_config(backends=backends))`` with the progress thread's poll timeout
    set to ``progress_poll_us`` (≥ 1000: NIXL rounds it up to whole milliseconds).

    Raises:
        ValueError: ``progress_poll_us`` < 1000 (0 is NIXL's own busy loop).
        Whatever `nixl._api.nixl_agent` raises.
    """
    if progress_poll_us < 1000:
        raise ValueError(f"progress_poll_us={progress_poll_us}: use at least 1000 (NIXL polls in whole ms)")
    base = nixl_api.nixlBind.nixlAgentConfig

    class SleepingProgressConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's field name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, progress_poll_us)

    with _SWAP_LOCK:
        nixl_api.nixlBind.nixlAgentConfig = SleepingProgressConfig
        try:
            return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=backends))
        finally:
            nixl_api.nixlBind.nixlAgentConfig = base
