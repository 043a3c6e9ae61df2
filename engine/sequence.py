"""`Sequence`: one sample of one request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstore.block_key import BlockKey
from model.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Token ids, block table and progress of one sample.

    ::

        token_ids:  [ prompt .............. | outputs ... ]
                     0       num_computed_tokens        len(token_ids)
                     └ KV in the blocks ──┘└ pending ──┘

    The engine owns every field; `BlockPool` owns the ref counts of the blocks in ``block_table``.
    """

    seq_id: int
    request_id: str
    index: int
    arrival: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    salt: bytes
    seed: int  # the request's seed, or one drawn at arrival; see model.sampling.token_generator
    block_table: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)
    num_computed_tokens: int = 0
    prefix_matched: bool = False  # the prefix cache was consulted since the last (re)admission
    num_keyed_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens reused from the prefix cache at admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    pinned_block_ids: list[int] = field(default_factory=list)  # refs handed over by the caller, see add_request
    forked: bool = False  # n > 1: the other samples have been split off this one

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """One pending token after at least one output: the next step is a decode step."""
        return self.num_output_tokens > 0 and self.num_pending_tokens == 1
