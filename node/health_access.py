"""Who may read a server's internals on ``/health``: the bare answer for anyone, the full one for an operator.

``/health`` stays open for probes (k8s, load balancers), which need only the status code. The full body (the
pid, node URLs, node errors with host:port, queue depths) goes only to a caller holding the internal token
(``X-Kvrelay-Token``: `kvrelay up`, the nodes' peers, operators) or, on the router, a valid API key. A server
with neither configured has nothing to check a caller against, and answers in full.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from kvrelay.transfer.config import TOKEN_HEADER


def sees_internals(request: web.Request, *, internal_token: str | None, api_keys: tuple[str, ...] = ()) -> bool:
    """Whether ``request`` may read the full ``/health``: it carries ``internal_token`` as ``X-Kvrelay-Token``,
    or one of ``api_keys`` as a Bearer token; True when neither is configured."""
    if internal_token is None and not api_keys:
        return True
    given = request.headers.get(TOKEN_HEADER, "")
    if internal_token is not None and given and hmac.compare_digest(given.encode(), internal_token.encode()):
        return True
    header = request.headers.get("Authorization", "")
    bearer = header[7:].strip() if header.lower().startswith("bearer ") else ""
    return bool(bearer) and any(hmac.compare_digest(bearer.encode(), key.encode()) for key in api_keys)


def bare_health(status: str, code: int) -> web.Response:
    """The answer for a caller without the token: ``{"status": ...}`` and the status code, nothing else."""
    return web.json_response({"status": status}, status=code)
