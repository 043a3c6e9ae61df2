"""Block keys: the chained prefix hash of docs/design.md §2.

::

    key_0 = sha256(b"kvrelay.block.v1" ‖ spec_fingerprint ‖ len(salt) as u32-LE ‖ salt ‖ tokens_0 as u32-LE)
    key_i = sha256(b"kvrelay.block.v1" ‖ key_{i-1}        ‖ tokens_i as u32-LE)

A key names the whole prefix up to and including its block. Only full blocks get keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockKey = NewType("BlockKey", bytes)

KEY_DOMAIN = b"kvrelay.block.v1"
GROUP_DOMAIN = b"kvrelay.group.v1"
MAX_TOKEN_ID = 2**32 - 1


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None


def block_keys(
    token_ids: Sequence[int], *, block_size_tokens: int, spec_fingerprint: bytes, salt: bytes = b""
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``; a partial tail block gets none.

    Args:
        token_ids: the sequence's tokens, each in ``[0, 2**32)``.
        block_size_tokens: tokens per block.
        spec_fingerprint: `BlockSpec.fingerprint` (32 bytes).
        salt: per-tenant cache salt; different salts never share a key.

    Returns:
        ``len(token_ids) // block_size_tokens`` keys of 32 bytes each.

    Raises:
        ValueError: a token id is out of range or the salt is longer than 2**32 - 1 bytes.
    """
    if len(salt) > MAX_TOKEN_ID:
        raise ValueError("salt is longer than 2**32 - 1 bytes")
    keys: list[BlockKey] = []
    prev = spec_fingerprint + struct.pack("<I", len(salt)) + salt
    num_full = len(token_ids) // block_size_tokens
    for i in range(num_full):
        chunk = token_ids[i * block_size_tokens : (i + 1) * block_size_tokens]
        key = BlockKey(hashlib.sha256(KEY_DOMAIN + prev + _tokens_bytes(chunk)).digest())
        keys.append(key)
        prev = key
    return keys


def extend_block_keys(
    keys: list[BlockKey],
    token_ids: Sequence[int],
    *,
    block_size_tokens: int,
    spec_fingerprint: bytes,
    salt: bytes = b"",
) -> list[BlockKey]:
    """Append to ``keys`` the keys of full blocks of ``token_ids`` that it does not have yet.

    ``keys`` must be the keys of the first ``len(keys)`` blocks of ``token_ids``. Mutates and returns ``keys``.
    """
    num_full = len(token_ids) // block_size_tokens
    if len(keys) == 0:
        keys.extend(block_keys(token_ids, block_size_tokens=block_size_tokens,
                               spec_fingerprint=spec_fingerprint, salt=salt))
        return keys
    for i in range(len(keys), num_full):
        chunk = token_ids[i * block_size_tokens : (i + 1) * block_size_tokens]
        keys.append(BlockKey(hashlib.sha256(KEY_DOMAIN + keys[-1] + _tokens_bytes(chunk)).digest()))
    return keys


def group_key(key: BlockKey, group: int) -> BlockKey:
    """The key of group ``group``'s block of the 16-token block ``key`` names (`BlockSpec.num_groups`):
    ``key`` itself for group 0, ``sha256(b"kvrelay.group.v1" ‖ key ‖ group as u32-LE)`` for the others."""
    if group == 0:
        return key
    return BlockKey(hashlib.sha256(GROUP_DOMAIN + key + struct.pack("<I", group)).digest())


def extend_group_keys(keys: list[BlockKey], token_ids: Sequence[int], *, num_groups: int, block_size_tokens: int,
                      spec_fingerprint: bytes, salt: bytes = b"") -> list[BlockKey]:
    """`extend_block_keys` for a table of ``num_groups`` blocks per 16-token block: ``keys`` holds, for each
    full token block i, the keys of its groups in order (entry ``i·G + g`` is ``group_key(key_i, g)``).
    Mutates and returns ``keys``."""
    if num_groups == 1:
        return extend_block_keys(keys, token_ids, block_size_tokens=block_size_tokens,
                                 spec_fingerprint=spec_fingerprint, salt=salt)
    base = keys[::num_groups]
    known = len(base)
    extend_block_keys(base, token_ids, block_size_tokens=block_size_tokens, spec_fingerprint=spec_fingerprint,
                      salt=salt)
    for key in base[known:]:
        keys.extend(group_key(key, g) for g in range(num_groups))
    return keys
