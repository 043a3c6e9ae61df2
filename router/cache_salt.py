"""A request's KV cache salt: the tenant's (derived from its API key by the router), narrowed by vLLM's
``cache_salt`` request field.

    tenant salt (API key)  ──┐
                             ├─ request_salt ─▶ the salt the block keys and the nodes use
    cache_salt (request)   ──┘

A client's ``cache_salt`` can only split its own tenant's cache further: two requests share a block only when
they have the same API key *and* the same ``cache_salt`` (or both none), so a cache_salt never reaches another
tenant's blocks. The router's queue still counts the request under its tenant (the API key), not the salt.
"""

from __future__ import annotations

import hashlib

from kvrelay.transfer.wire import TENANT_SALT_BYTES

MAX_CACHE_SALT_CHARS = 1024


def request_salt(tenant_salt: bytes, cache_salt: str | None) -> bytes:
    """The salt for a request of the tenant with ``tenant_salt`` (b"": no API keys) and ``cache_salt`` (None:
    the tenant's own). Returns ``tenant_salt`` itself without a cache_salt, else `TENANT_SALT_BYTES` bytes."""
    if cache_salt is None:
        return tenant_salt
    digest = hashlib.sha256(b"kvrelay.cache_salt.v1" + len(tenant_salt).to_bytes(4, "little") + tenant_salt
                            + cache_salt.encode())
    return digest.digest()[:TENANT_SALT_BYTES]
