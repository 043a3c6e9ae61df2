"""Issue 30, failure mode 6: a prefill node that is merely slow (a 1 s sleep before every engine step) is
not taken out, its streams are not ended, and every request of a load is answered 200. The health poll has
connections of its own, and only a failed connect makes a node unreachable; a slow answer is counted.

Every handle names keys of another prompt (the test hook's ``KVRELAY_TEST_PUBLISH_FAULTS``), so the decode node
refuses it before any contact and the router releases each lease (`POST /kv/lease/release`): on the slow node each
release waits for an engine step, and they queue on the router's control connections to it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.services.cluster import Cluster, get_json, metrics

SLOW_SITE = Path(__file__).parent / "slow_node"  # its sitecustomize.py slows the node named in the variable


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_slow_prefill_node_is_not_taken_out(tiny_model_dir, tmp_path):
    steps = tmp_path / "slow-steps"
    # The slow-node hook chains the shared one, which injects the fault (`tests.services.cluster.publish_faults`).
    env = {"PYTHONPATH": str(SLOW_SITE), "KVRELAY_TEST_SLOW_NODE": f"prefill-0:1.0:{steps}",
           "KVRELAY_TEST_PUBLISH_FAULTS": "handle_with_other_keys"}
    overrides = {"router": {"request_timeout_s": 240}}
    with Cluster(tiny_model_dir, prefill=2, decode=1, env=env, overrides=overrides) as c:
        # A long shared prefix, cached on the slow node first: the router keeps sending it work there.
        prefix = "".join(chr(97 + (i * 7) % 26) for i in range(320))
        code, _ = _post(c.url, {"model": "tiny", "prompt": prefix, "max_tokens": 2, "temperature": 0})
        assert code == 200
        bodies = [{"model": "tiny", "prompt": prefix + f" request {i}", "max_tokens": 6,
                   "temperature": 0, "ignore_eos": True} for i in range(300)]
        with ThreadPoolExecutor(48) as pool:
            results = list(pool.map(lambda b: _post(c.url, b), bodies))
        codes = [code for code, _ in results]
        assert codes.count(200) == 300, [r for r in results if r[0] != 200][:3]
        assert all(body["usage"]["completion_tokens"] == 6 for _, body in results)
        nodes = get_json(c.url + "/health")["nodes"]
        assert {name: (n["healthy"], n["times_down"]) for name, n in nodes.items()} == {
            "prefill-0": (True, 0), "prefill-1": (True, 0), "decode-0": (True, 0)}, nodes
        # The delay was in place, and the slow node served some of the load.
        assert len(steps.read_text().splitlines()) >= 2
        served = metrics(c.prefill_urls[0]).get('kvrelay_requests_total{role="prefill",status="ok"}', 0)
        assert served >= 1
        released = metrics(c.decode_urls[0]).get('kvrelay_kv_transfer_failures_total{reason="key_mismatch"}', 0)
        assert released == 301  # every handle refused (the warm-up's too): every lease released by the router
