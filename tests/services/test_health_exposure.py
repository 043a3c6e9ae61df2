"""Issue 65, exposure: an unauthenticated ``/health`` (router and nodes) answers only its status.

Probes need the status code alone; the pid, node URLs and raw error text go only to a caller with the internal
token (``X-Kvrelay-Token``) or, on the router, a valid API key (`node.health_access`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvrelay.transfer.config import TOKEN_HEADER

from tests.services.cluster import Cluster

API_KEY = "sk-edge-test"


def _health(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    req = urllib.request.Request(url + "/health", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_health_is_bare_without_the_token_and_full_with_it_or_an_api_key(tiny_model_dir):
    with Cluster(tiny_model_dir, overrides={"router": {"api_keys": [API_KEY]}}) as c:
        router, node = c.url, c.decode_urls[0]
        bare = [_health(router, {}), _health(router, {TOKEN_HEADER: "wrong"}),
                _health(router, {"Authorization": "Bearer sk-wrong"}), _health(node, {}),
                _health(node, {TOKEN_HEADER: "wrong"}), _health(node, {"Authorization": f"Bearer {API_KEY}"})]
        by_token = _health(router, {TOKEN_HEADER: c.token})
        by_key = _health(router, {"Authorization": f"Bearer {API_KEY}"})
        node_full = _health(node, {TOKEN_HEADER: c.token})
    assert bare == [(200, {"status": "ok"})] * 6
    for code, body in (by_token, by_key):
        assert code == 200 and body["status"] == "ok" and isinstance(body["pid"], int)
        assert set(body["nodes"]) == {"prefill-0", "decode-0"} and body["nodes"]["decode-0"]["url"] == node
    assert node_full[0] == 200 and node_full[1]["status"] == "ok" and node_full[1]["node"] == "decode-0"
    assert isinstance(node_full[1]["pid"], int) and "disk_tier" in node_full[1]
