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
owner runs with ``kvstore.integrity: off`` (a reader that checks integrity refuses such a handle).

The binding. The owner records, with the lease, the `binding` of what it leased: one SHA-256 over every
``(key, tier, block id, digest)`` of the handle it built. The reader names the binding of the handle it
holds in every lease renewal, and the owner refuses a renewal whose binding is not the lease's
(`transfer.lease.BindingMismatch`, HTTP 409). A handle that was altered on its way (other block ids for the
same keys, other digests, other keys) thus cannot be confirmed, and the reader confirms it before it
posts a READ (`transfer.puller`): NIXL READs are one-sided, so the owner could not refuse the READ itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.kvstore.block_key import BlockKey
from kvrelay.transfer.lease import TierBlock

BINDING_BYTES = 32
_BINDING_DOMAIN = b"kvrelay.lease-binding.v1"


def binding_of(keys: Sequence[BlockKey], blocks: Sequence[TierBlock], digests: Sequence[int]) -> bytes:
    """The binding (32 bytes) of ``keys[i]`` held at ``blocks[i]`` with digest ``digests[i]`` (none: integrity off)::

        sha256("kvrelay.lease-binding.v1" ‖ u32 n ‖ u8 has_digests ‖ for each i:
               key_i ‖ u16 len(tier_i) ‖ tier_i ‖ u64 block_id_i ‖ u64 digest_i (if has_digests))   (LE ints)
    """
    h = hashlib.sha256(_BINDING_DOMAIN)
    h.update(len(keys).to_bytes(4, "little") + bytes([1 if digests else 0]))
    for i, (key, (tier, block_id)) in enumerate(zip(keys, blocks, strict=True)):
        name = tier.encode()
        h.update(bytes(key) + len(name).to_bytes(2, "little") + name + block_id.to_bytes(8, "little"))
        if digests:
            h.update(digests[i].to_bytes(8, "little"))
    return h.digest()


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
    def binding(self) -> bytes:
        """`binding_of` this handle's keys, blocks and digests: what a renewal asks the owner to confirm."""
        return binding_of(self.keys, self.blocks, self.digests)

    @property
    def meta_url(self) -> str:
        return self.owner_url + "/kv/meta"

    @property
    def renew_url(self) -> str:
        return self.owner_url + "/kv/lease/renew"
