"""`Sequence`: one sample of one request as the engine tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvrelay.engine.grammar import Matcher
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.sampling_params import PromptTokenLogprobs


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

    Under a long-context policy (`engine.kv_policy`) ``block_table`` holds only the KV on device:
    ``num_absent_tokens`` tokens have no KV there (H2O evicted them, or InfiniGen moved them to
    host), so the KV length is ``num_computed_tokens - num_absent_tokens`` and the table no longer
    follows token order (``keys_stopped``: its blocks are never keyed again). ``kv_corrupt``: a policy
    found KV this step attends to corrupt (an InfiniGen recall failed its digest); the engine then
    discards the token the step samples for it and preempts it, so its KV is recomputed from its tokens.

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
    num_dropped_blocks: int = 0  # leading 16-token blocks whose sliding-group blocks were given back
    cold_from: int | None = None  # blocks from this index on are keyed cold (kvstore.policy); None: none
    tail_scored: bool = False  # the store's TailCap has seen this prompt (once per prompt)
    num_cached_prompt_tokens: int = 0  # prompt tokens reused from the prefix cache at admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    pinned_block_ids: list[int] = field(default_factory=list)  # refs handed over by the caller, see add_request
    forked: bool = False  # n > 1: the other samples have been split off this one
    long_context: LongContextConfig | None = None  # the request's policy (None: full attention)
    num_absent_tokens: int = 0  # computed tokens whose KV is not in block_table (see above)
    keys_stopped: bool = False  # a policy rewrote block_table: no more of its blocks are keyed
    kv_corrupt: bool = False  # set during a step by a policy, cleared by the engine after it (see above)
    kv_recomputes: int = 0  # times its KV was recomputed after a failed integrity check
    matcher: Matcher | None = None  # its grammar's state, when the request is constrained (engine.grammar)
    # its prompt's logprobs so far, positions 1.. (engine.prompt_logprobs), while its prefill computes them
    prompt_logprobs: list[PromptTokenLogprobs] = field(default_factory=list)

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
    def num_kv_tokens(self) -> int:
        """Tokens whose KV sits in ``block_table``: the next token's KV goes to row ``num_kv_tokens``."""
        return self.num_computed_tokens - self.num_absent_tokens

    @property
    def is_decode(self) -> bool:
        """One pending token after at least one output: the next step is a decode step."""
        return self.num_output_tokens > 0 and self.num_pending_tokens == 1
