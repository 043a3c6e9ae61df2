"""`Node` and `NodeCapacity`: what the router knows of one node — what the node reports about itself, and the
router's own ledger of what it placed there. `router.nodes` places requests by them, `router.plan` prices plans.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What a node reports about itself in its event answers (``load``: `node.app.EngineNode.load_report`).

    ``prefill_tokens_per_s``, ``decode_step_s`` and the ``step_*`` cost are measured by the node
    (`engine.step_rates`); 0.0 until it has run a step of that kind (a report without ``step_*``: 0.0).
    """

    kv_blocks: int
    free_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_tokens_per_s: float
    decode_step_s: float
    max_pending_requests: int = 1 << 30  # what the node admits at once (it answers 429 beyond)
    block_bytes: int = 0  # bytes of one 16-token block, all groups (0: not reported)
    pull_bytes_per_s: float = 0.0  # how fast it pulls KV from peers (`engine.step_rates.PullRates`); 0.0: no pull yet
    pull_fixed_s: float = 0.0
    whole_requests: bool = False  # a prefill node that also serves whole requests (``POST /generate``)
    # its fitted step cost (`engine.step_rates.StepCost`): seconds per step, per prompt token, per decode row
    step_fixed_s: float = 0.0
    step_prefill_token_s: float = 0.0
    step_decode_row_s: float = 0.0

    @classmethod
    def from_report(cls, report: Any) -> NodeCapacity:
        """Raises ValueError for a malformed report."""
        try:
            cap = cls(int(report["kv_blocks"]), int(report["free_blocks"]), int(report["max_num_seqs"]),
                      int(report["max_num_batched_tokens"]), float(report["prefill_tokens_per_s"]),
                      float(report["decode_step_s"]), int(report.get("max_pending_requests", 1 << 30)),
                      int(report.get("block_bytes", 0)), float(report.get("pull_bytes_per_s", 0.0)),
                      float(report.get("pull_fixed_s", 0.0)), report.get("whole_requests", False) is True,
                      float(report.get("step_fixed_s", 0.0)), float(report.get("step_prefill_token_s", 0.0)),
                      float(report.get("step_decode_row_s", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed load report: {exc!r}") from None
        if min(cap.kv_blocks, cap.max_num_seqs, cap.max_num_batched_tokens, cap.max_pending_requests) < 1 or \
                cap.free_blocks < 0 or cap.block_bytes < 0 or \
                not (cap.prefill_tokens_per_s >= 0 and cap.decode_step_s >= 0 and cap.pull_bytes_per_s >= 0
                     and cap.pull_fixed_s >= 0 and cap.step_fixed_s >= 0 and cap.step_prefill_token_s >= 0
                     and cap.step_decode_row_s >= 0):
            raise ValueError(f"load report out of range: {cap}")
        return cap


ITL_DECAY = 0.05  # weight of the newest inter-token gap in a node's decayed ITL (`Node.itl_s`)


@dataclass(slots=True)
class StreamPace:
    """One request decoding on a node, as the router sees its first sample's tokens go out: when its first
    token came (``first_at``, `time.monotonic` seconds), how many it has sent (``sent``), when the last came
    (``last_at``), and how many it is expected to send in all (``expected``: ``max_tokens`` capped at
    ``router.decode_reserve_tokens``, never below ``sent``)."""

    first_at: float
    sent: int
    last_at: float
    expected: int

    def projected_tpot_s(self, now: float, itl_s: float, stall_s: float = 0.0) -> float:
        """The request's time per output token when it ends, in seconds, if its remaining tokens come every
        ``itl_s`` and one stall of ``stall_s`` delays them all: ``(elapsed + stall + remaining · itl) /
        (expected − 1)``; 0.0 for a request of one token."""
        total = max(self.expected, self.sent)
        if total <= 1:
            return 0.0
        return ((now - self.first_at) + stall_s + (total - self.sent) * itl_s) / (total - 1)


@dataclass(slots=True)
class Node:
    name: str
    url: str
    role: str
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens placed here and not yet prefilled (`Reservation`)
    reserved_blocks: int = 0  # KV blocks the router's placed requests hold here (`Reservation`)
    reserved_seqs: int = 0  # samples the router's placed requests run here (decode nodes)
    reserved_requests: int = 0  # placed requests the node is serving (a prefill node: until it answers)
    capacity: NodeCapacity | None = None  # the node's last load report; None until it reports
    down_until: float = 0.0
    failures: int = 0
    seen: bool = False  # answered at least once; until then it is polled at every round
    last_error: str = ""  # why the last call failed; cleared when it answers
    times_down: int = 0  # how often it was taken out after it had answered (never reset)
    slow_polls: int = 0  # health polls it took but did not answer in time (it stays in; never reset)
    # Set when the health poll finds the node unreachable, and at once replaced by a fresh one: the
    # requests waiting on it then give up (`router.backends.Backends`) instead of waiting out their read
    # timeout on a host that is gone (it sends no reset); later requests wait on the fresh one.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    # Answers being read from the node now (aiohttp stream readers); `NodeSet.mark_unreachable` ends them.
    readers: set[Any] = field(default_factory=set)
    # Requests decoding here (decode nodes; key: the router's request), and the decayed time between their
    # tokens as the router receives them (seconds; 0.0 until measured): `router.plan` prices the delay a
    # local prefill adds to them against the TPOT SLO.
    streams: dict[int, StreamPace] = field(default_factory=dict)
    itl_s: float = 0.0

    def observe_tokens(self, key: int, *, tokens: int, now: float, expected: int) -> None:
        """``tokens`` more of request ``key``'s first sample reached the router at ``now`` from this node; the
        first call registers it (`StreamPace`), later ones fold the gap per token into `itl_s`."""
        pace = self.streams.get(key)
        if pace is None:
            self.streams[key] = StreamPace(now, tokens, now, max(expected, tokens))
            return
        if tokens > 0:
            gap = (now - pace.last_at) / tokens
            self.itl_s = gap if self.itl_s == 0.0 else (1 - ITL_DECAY) * self.itl_s + ITL_DECAY * gap
            pace.sent += tokens
            pace.expected = max(pace.expected, pace.sent)
            pace.last_at = now

    def stream_ended(self, key: int) -> None:
        self.streams.pop(key, None)

    def healthy(self, now: float) -> bool:
        return now >= self.down_until
