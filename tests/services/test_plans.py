"""Issue 31: ``router.disaggregation: auto`` through real processes — where each prompt is prefilled, and that every
plan gives the same greedy tokens.

The router picks per request (`router.plan`): a short prompt, or one whose prefix the decode node holds, is
prefilled on the decode node; a long one goes to the prefill node while the decode node is busy decoding; a slow
link between them makes the decode node recompute instead of pulling.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer

from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_faults import post, wait_for
from tests.services.test_migration import reference

HOOKS = os.path.join(os.path.dirname(__file__), "hooks")


def plans(url: str) -> tuple[int, int]:
    """(disaggregated, local) requests the router placed so far."""
    m = metrics(url)
    return (int(m.get('kvrelay_router_plans_total{plan="disaggregated"}', 0)),
            int(m.get('kvrelay_router_plans_total{plan="local"}', 0)))


def pulled_bytes(decode_url: str) -> float:
    return metrics(decode_url).get("kvrelay_kv_transfer_bytes_total", 0.0)


def decode_node(c: Cluster) -> dict:
    """The router's view of decode-0 (its ``/health``): capacity and rates it reported, keys it indexed."""
    return get_json(c.url + "/health")["nodes"]["decode-0"]


def wait_for_the_pull_rate(c: Cluster) -> None:
    wait_for(lambda: (decode_node(c)["capacity"] or {}).get("pull_bytes_per_s", 0) > 0,
             what="the decode node's pull rate reported to the router")


def complete(url: str, prompt: list[int], max_tokens: int = 16) -> str:
    code, body = post(url, {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert code == 200, body
    return body["choices"][0]["text"]


def while_busy(c: Cluster, prompt: list[int], busy: int) -> tuple[str, str]:
    """``prompt``'s greedy text, sent while ``busy`` long streams decode on the (only) decode node, and the plan
    the router placed it by."""
    (decode,) = c.decode_urls
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(busy) as pool:
        futures = [pool.submit(post, c.url, body) for _ in range(busy)]
        wait_for(lambda: get_json(decode + "/health")["running"] == busy, what=f"{busy} streams decoding")
        before = plans(c.url)  # the busy streams' first tokens came: their plans are counted
        text = complete(c.url, prompt)
        after = plans(c.url)
        for f in futures:
            assert f.result(timeout=300)[0] == 200
    assert sum(after) - sum(before) == 1
    return text, "disaggregated" if after[0] > before[0] else "local"


def test_auto_keeps_short_and_held_prompts_on_the_decode_node_and_sends_long_ones_to_prefill(tiny_model_dir):
    rng = random.Random(31)
    warm, long = ([rng.randrange(3, 256) for _ in range(n)] for n in (600, 900))
    short = [rng.randrange(3, 256) for _ in range(256)]  # 16 whole blocks
    longer_short = short + [rng.randrange(3, 256) for _ in range(4)]
    prompts = [warm, short, longer_short, long]
    tok = load_tokenizer(tiny_model_dir)
    expected = [tok.decode(ids) for ids in reference(tiny_model_dir, prompts, [SamplingParams(max_tokens=16)] * 4)]
    with Cluster(tiny_model_dir, overrides={"router": {"disaggregation": "auto"}}) as c:
        (decode,) = c.decode_urls
        # Nothing measured yet: the prefill node computes, the decode node pulls (and both learn their rates).
        assert complete(c.url, warm) == expected[0]
        assert plans(c.url) == (1, 0) and pulled_bytes(decode) > 0
        wait_for_the_pull_rate(c)
        # The router's index of the decode node: the 37 pulled blocks, and the 38th, filled by decoding, whose KV
        # event comes a little after the answer (reading the count before it came made the check below wait for
        # 53 while the index went from 38 to 54).
        wait_for(lambda: decode_node(c)["kv_keys"] == (600 + 15) // 16, what="the warm request's 38 blocks indexed")
        before, keys = pulled_bytes(decode), decode_node(c)["kv_keys"]
        # An idle decode node takes a shorter prompt itself: no pull, and its blocks are published like a prefill
        # node's (KV events: the router's index has them).
        assert complete(c.url, short) == expected[1]
        assert plans(c.url) == (1, 1) and pulled_bytes(decode) == before
        wait_for(lambda: decode_node(c)["kv_keys"] == keys + 16, what="the decode node's 16 new blocks indexed")
        # The same 16 blocks and 4 tokens more: the decode node holds the prefix and computes 4 tokens.
        hits = metrics(decode)["kvrelay_engine_prefix_hit_tokens_total"]
        assert complete(c.url, longer_short) == expected[2]
        assert plans(c.url) == (1, 2) and pulled_bytes(decode) == before
        assert metrics(decode)["kvrelay_engine_prefix_hit_tokens_total"] - hits == 256
        # A long prompt while the decode node is busy: the prefill node computes it, the decode node pulls.
        assert while_busy(c, long, 16) == (expected[3], "disaggregated")
        assert pulled_bytes(decode) > before


def test_a_slow_link_makes_the_decode_node_recompute_instead_of_pulling(tiny_model_dir):
    """Every pull takes 5 s more: after the first (nothing measured), the router keeps even a long prompt on the
    busy decode node, since recomputing it there costs less than waiting for the link."""
    rng = random.Random(32)
    warm, long = ([rng.randrange(3, 256) for _ in range(n)] for n in (600, 900))
    tok = load_tokenizer(tiny_model_dir)
    expected = [tok.decode(ids) for ids in reference(tiny_model_dir, [warm, long], [SamplingParams(max_tokens=16)] * 2)]
    env = {"KVRELAY_TEST_SLOW_PULL_S": "5",
           "PYTHONPATH": os.pathsep.join([HOOKS, *filter(None, [os.environ.get("PYTHONPATH")])])}
    # No TPOT guard here (tpot_slo_s 0): on a busy machine the decode node's streams can already run past it, and
    # the plan that breaches fewer would win whatever the link costs; this test is about the link.
    with Cluster(tiny_model_dir, env=env, overrides={"router": {"disaggregation": "auto", "tpot_slo_s": 0}}) as c:
        (decode,) = c.decode_urls
        assert complete(c.url, warm) == expected[0]
        assert plans(c.url) == (1, 0)
        wait_for_the_pull_rate(c)
        before = pulled_bytes(decode)
        assert while_busy(c, long, 4) == (expected[1], "local")
        assert pulled_bytes(decode) == before


def test_a_prefill_node_that_serves_whole_requests_takes_its_share_under_auto(tiny_model_dir):
    """``prefill.serve_whole_requests``: under auto the router places requests on the prefill node as on a decode
    node; it prefills and decodes them itself (``/generate``, no pull), and every request gives the greedy tokens
    of one engine. It goes there when that costs less than the decode node's plan (`tests/router/test_plan.py`
    prices it) or when the decode node has no room, which makes the split sure here: two sequences a step, so the
    decode node holds four."""
    rng = random.Random(33)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(20, 200))] for _ in range(8)]
    tok = load_tokenizer(tiny_model_dir)
    ids = reference(tiny_model_dir, prompts, [SamplingParams(max_tokens=32)] * 8)
    expected = [tok.decode(t) for t in ids]
    total = len(ids[0]) + sum(map(len, ids))  # tokens of the first request twice over, then of all eight
    overrides = {"router": {"disaggregation": "auto"}, "prefill": {"serve_whole_requests": True},
                 "engine": {"max_num_seqs": 2}}
    with Cluster(tiny_model_dir, overrides=overrides) as c:
        (prefill,), (decode,) = c.prefill_urls, c.decode_urls
        wait_for(lambda: (get_json(c.url + "/health")["nodes"]["prefill-0"]["capacity"] or {}).get(
            "whole_requests") is True, what="the prefill node's load report to say it serves whole requests")
        # Nothing measured yet: the first request is disaggregated (both nodes learn their rates)
        assert complete(c.url, prompts[0], max_tokens=32) == expected[0] and plans(c.url) == (1, 0)
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: complete(c.url, p, max_tokens=32), prompts))
        assert texts == expected

        def generated() -> dict[str, float]:
            key = 'vllm:generation_tokens_total{engine="0",model_name="tiny"}'  # vLLM's labels (node.vllm_metrics)
            return {url: metrics(url).get(key, 0.0) for url in (prefill, decode)}

        # The tokens of all 9 however they were placed (a disaggregated one: its first token on the prefill node,
        # the rest on the decode node); each node generated more than first tokens: whole requests on both.
        wait_for(lambda: sum(generated().values()) == total, what="the nodes' token counters")
        assert generated()[prefill] > 9 and generated()[decode] > len(ids[0])
        assert sum(plans(c.url)) == 9
