"""Gap B of the 2026-12-07 edges notes through real processes (SmolLM2-135M-Instruct, 1 prefill + 1 decode node,
two API keys): an EBNF grammar past the router's limits is a 400 naming the field that no node sees; a grammar
within them that compiles for longer than ``engine.grammar_compile_timeout_s`` is a 400 naming the field while
another tenant's plain and constrained requests are served; one tenant's new constraints past
``router.max_compiling_requests_per_tenant`` get 429 while another tenant's do not."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.real_model import RealModel
from tests.services.cluster import Cluster, metrics

MODEL = "smollm2-135m-instruct"
KEY_A, KEY_B = "key-a", "key-b"
# 11 KB, 1 rule, no parentheses or alternatives: within every router limit; ~16 s to compile for SmolLM2's
# vocabulary on one shared core (the HTTP API reference's table)
SLOW = "root ::= " + " ".join(["[a-z]*"] * 1600)
SLOW_MESSAGE = "structured output: the grammar constraint took longer than 2 s to compile"


@pytest.fixture(scope="module")
def cluster(smollm2: RealModel):
    overrides = {"model": {"name": MODEL, "dtype": "float32"},
                 "router": {"api_keys": [KEY_A, KEY_B], "request_timeout_s": 240,
                            "max_compiling_requests_per_tenant": 1},
                 "engine": {"grammar_compile_timeout_s": 2}}
    with Cluster(smollm2.model_dir, overrides=overrides) as c:
        yield c


def post(url: str, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": MODEL, "prompt": "Say yes.", "max_tokens": 3,
                                                  "temperature": 0, **body}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=240) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def node_requests(cluster: Cluster) -> float:
    return sum(v for u in cluster.prefill_urls + cluster.decode_urls for k, v in metrics(u).items()
               if k.startswith("kvrelay_requests_total"))


def test_a_grammar_nested_past_the_limit_is_a_400_from_the_router_that_no_node_sees(cluster: Cluster):
    before = node_requests(cluster)
    for k, message in ((500, "structured_outputs.grammar has 500 levels of parentheses, over the limit of 64 "
                             "(router.max_grammar_nesting)"),
                       (5000, "structured_outputs.grammar has 5000 levels of parentheses, over the limit of 64 "
                              "(router.max_grammar_nesting)"),
                       (30000, "structured_outputs.grammar is 60012 bytes, over the limit of 32768 "
                               "(router.max_grammar_bytes)")):
        status, body = post(cluster.url, KEY_A, {"structured_outputs": {"grammar": "root ::= " + "(" * k + '"a"'
                                                                        + ")" * k}})
        assert (status, body["error"]["param"], body["error"]["message"]) == \
            (400, "structured_outputs.grammar", message)
    assert node_requests(cluster) == before


def test_a_slow_grammar_is_a_400_while_another_tenant_is_served_and_a_tenant_s_new_grammars_are_bounded(
        cluster: Cluster):
    status, _ = post(cluster.url, KEY_B, {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert status == 200  # each node's compile child has started
    slow: list[tuple[int, dict[str, Any]]] = []
    thread = threading.Thread(target=lambda: slow.append(post(cluster.url, KEY_A,
                                                              {"structured_outputs": {"grammar": SLOW}})))
    thread.start()
    while not metrics(cluster.url).get('kvrelay_running_requests{role="router"}'):
        time.sleep(0.02)
    time.sleep(0.5)  # parsed and claimed (milliseconds); its node holds it for the 2 s deadline and more
    refused: list[tuple[int, dict[str, Any]]] = []
    served_b: list[int] = []
    i = 0
    while thread.is_alive() and not refused:  # A's slow request holds A's one place for new constraints
        i += 1
        status, body = post(cluster.url, KEY_A, {"structured_outputs": {"grammar": f'root ::= "a{i}"'}})
        if status == 429:
            refused.append((status, body))
        else:
            assert status == 200
    served_b.append(post(cluster.url, KEY_B, {})[0])  # plain
    served_b.append(post(cluster.url, KEY_B, {"structured_outputs": {"grammar": 'root ::= "ok" | "no"'}})[0])
    thread.join(timeout=240)
    assert not thread.is_alive()
    (status, body), = slow
    assert (status, body["error"]["param"], body["error"]["message"]) == \
        (400, "structured_outputs.grammar", SLOW_MESSAGE)
    assert refused and refused[0][1]["error"]["param"] == "structured_outputs.grammar"
    assert refused[0][1]["error"]["message"].endswith(
        "its limit (router.max_compiling_requests_per_tenant); retry when they are done")
    assert served_b == [200, 200]
    # the refusal is remembered on the node: a repeat is refused again (at once, without a compile)
    status, body = post(cluster.url, KEY_A, {"structured_outputs": {"grammar": SLOW}})
    assert (status, body["error"]["message"]) == (400, SLOW_MESSAGE)
