"""`KvHandle`: what an owner (prefill) gives a reader (decode) so it can pull KV blocks.

::

    KvHandle(owner_agent="prefill-0", owner_incarnation="9f…", owner_url="http://10.0.0.5:8101",
             keys=(k0, k1, k2), blocks=(("device", 17), ("device", 4), ("host", 230)),
             num_tokens=48, lease_id="c3…", lease_ttl_s=30.0, digests=(0x5be1…, 0x09f3…, 0xc0de…))

    keys[i] ── is held by the owner at ── blocks[i] = (tier, block id on that tier) ── with digest digests[i]

All blocks are full and keyed (a tail block shorter than ``block_size_tokens`` is never shared), so
``num_tokens == len(keys) * block_size_tokens`` (``len(keys) / G * block_size_tokens`` for a model with G
block groups: `BlockSpec.tokens_held`). The owner pins the blocks under ``lease_id`` until the
reader's completion notification, or until the lease expires (``lease_ttl_s`` after the last renew).
``owner_url`` is the base of the owner's transfer endpoints (``/kv/meta``, ``/kv/lease/renew``).
``digests`` (`kvstore.digest`, u64 each) are what the reader checks the READ's bytes against; empty when the
owner runs with ``kvstore.integrity: off`` or holds a block without one (then nothing is checked).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.block_key import BlockKey
from transfer.lease import TierBlock


@dataclass(frozen=True, slots=True)
class KvHandle:
    """A lease on blocks held by ``owner_agent``; encode with `transfer.wire.encode_handle`."""

    owner_agent: str
    owner_incarnation: str
    owner_url: str
    keys: tuple[BlockKey, ...]
    blocks: tuple[TierBlock, ...]
    num_tokens: int
    lease_id: str
    lease_ttl_s: float
    digests: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def meta_url(self) -> str:
        return self.owner_url + "/kv/meta"

    @property
    def renew_url(self) -> str:
        return self.owner_url + "/kv/lease/renew"
