"""A request's wait in the router's queue does not eat its generation deadline (issue 65 item 4, the edges
notes' gap D): ``router.request_timeout_s`` counts from placement, and the wait has its own bound
(``router.queue_timeout_s``, a 429 before any node works for the request)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.services.cluster import Cluster, metrics
from tests.services.test_aborts import settled
from tests.services.test_engine_stall import HANG_SITE, _arm
from tests.services.test_faults import post


def test_a_request_placed_late_gets_its_whole_deadline_to_run(tiny_model_dir, tmp_path):
    # One request at a time on one node; each takes ≥ 5 s (100 steps of ≥ 50 ms), so the third waits ≥ 10 s and
    # ends ≥ 15 s after it arrived: past a 12 s deadline counted from arrival, well inside one from placement.
    overrides = {"prefill": {"ports": []}, "engine": {"max_num_seqs": 1}, "decode": {"max_pending_requests": 1},
                 "router": {"request_timeout_s": 12, "queue_timeout_s": 60}}
    with Cluster(tiny_model_dir, overrides=overrides,
                 env={"PYTHONPATH": HANG_SITE, "KVRELAY_TEST_HANG_DIR": str(tmp_path)}) as c:
        _arm(tmp_path / "decode-0.step-delay", "0.05")
        body = {"model": "tiny", "prompt": "wait your turn", "max_tokens": 100, "ignore_eos": True}
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: post(c.url, body, 120), range(3)))
        assert [code for code, _ in results] == [200, 200, 200], results
        assert [b["usage"]["completion_tokens"] for _, b in results] == [100, 100, 100]
        m = metrics(c.url)
        assert m['kvrelay_requests_total{role="router",status="200"}'] == 3
        assert m["kvrelay_router_queue_wait_seconds_count"] == 3
        assert m["kvrelay_router_queue_wait_seconds_sum"] >= 10  # the second waited ≥ 5 s, the third ≥ 10 s
        assert not any(settled(c).values())
