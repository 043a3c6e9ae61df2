"""Every family `kvrelay tiny-model --arch` writes, served by a real ``kvrelay up`` (1 prefill + 1 decode node):
greedy tokens equal transformers' (float32, eager) with the prompt's KV moved over NIXL, cold and extending a
cached prompt; for gpt-oss (sliding window 32 alternating with full layers, sinks) also prefix hits from the host
and the disk tier, and mixed-length requests sent together.

The model directories have no ``tokenizer.json``: the router then names each token ``token_id:N`` in the
completion's logprobs (exact ids; the byte-level tokenizer's text would fold bytes >= 0x80 that are not UTF-8
into U+FFFD, and the ids 256 and 257 into specials)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
from kvrelay.engine.engine import LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.tiny import TINY_ARCHS, TINY_WINDOW, write_tiny_model

from tests.model.test_families import LENGTHS, OUT_TOKENS, _hf_greedy, _prompts
from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_disagg import prefix_hits, transfer
from tests.services.test_faults import post, wait_for

BLOCK_TOKENS = 16
# The prompts of tests/model/test_families.py (seed 4: no near-tie in any family's greedy choice), by length.
LENGTH_TO_PROMPT = dict(zip(LENGTHS, _prompts(), strict=True))
SHORT, LONG = 17, 2 * TINY_WINDOW + 7  # one full block + 1 token; 4 full blocks + 7, past twice the window
# The long prompt, then the short one: its first 4 blocks are the long prompt's (every family's greedy choice
# over it wins by >= 7e-2 in transformers' logits).
EXTENDED = LENGTH_TO_PROMPT[LONG] + LENGTH_TO_PROMPT[SHORT]
NAME_TO_PROMPT = {**{str(n): p for n, p in LENGTH_TO_PROMPT.items()}, "extended": EXTENDED}


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, list[int]]]]:
    """``family(arch)`` → (its model directory, without tokenizer.json; prompt name in `NAME_TO_PROMPT` →
    transformers' greedy tokens), made once per arch."""
    cache: dict[str, tuple[Path, dict[str, list[int]]]] = {}

    def get(arch: str) -> tuple[Path, dict[str, list[int]]]:
        if arch not in cache:
            path = write_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch=arch, layers=4)
            (path / "tokenizer.json").unlink()
            expected = _hf_greedy(path, list(NAME_TO_PROMPT.values()))
            cache[arch] = path, dict(zip(NAME_TO_PROMPT, expected, strict=True))
        return cache[arch]

    return get


def complete(url: str, prompt: list[int]) -> list[int]:
    """Greedy ``OUT_TOKENS`` tokens for ``prompt`` from the router, as token ids."""
    code, body = post(url, {"model": "tiny", "prompt": prompt, "max_tokens": OUT_TOKENS, "min_tokens": OUT_TOKENS,
                            "temperature": 0, "logprobs": 0})
    assert code == 200, body
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == OUT_TOKENS
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def block_shape(model_dir: Path) -> tuple[int, int]:
    """(bytes of one 16-token block, pool blocks per 16-token block): a hybrid model (gpt-oss) pages its
    full and its sliding layers in blocks of their own (`BlockSpec.num_groups`)."""
    spec = LLMEngine.block_spec_for(load_model(model_dir), BLOCK_TOKENS)
    return spec.block_bytes * spec.num_groups, spec.num_groups


def idle(c: Cluster) -> bool:
    """No block in use on any node and no lease open on the prefill nodes."""
    health = {u: get_json(u + "/health") for u in c.prefill_urls + c.decode_urls}
    return (all(h["in_use_blocks"] == 0 for h in health.values())
            and all(health[u]["leases"] == 0 and health[u]["leased_blocks"] == 0 for u in c.prefill_urls))


def work(url: str) -> tuple[float, float]:
    """A node's prompt tokens so far: (served from its cache or pulled, computed)."""
    m = metrics(url)
    return m.get("kvrelay_engine_prefix_hit_tokens_total", 0.0), m.get("kvrelay_engine_prefill_tokens_total", 0.0)


def integrity_failures(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("kvrelay_kv_integrity_failures_total{"))


@pytest.mark.parametrize("arch", TINY_ARCHS)  # ~7 s each, most of it `kvrelay up` starting
def test_each_family_through_prefill_and_decode_equals_transformers(family, arch):
    """The short and the long prompt cold; then the extended one: the prefill node reuses the long prompt's 4
    blocks and computes the rest, the decode node holds those 4 and pulls only the fifth."""
    path, expected = family(arch)
    one_block, groups = block_shape(path)
    assert groups == (2 if arch == "gpt-oss" else 1)
    with Cluster(path, overrides={"kvstore": {"integrity": "all"}}) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        for n in (SHORT, LONG):
            assert complete(c.url, LENGTH_TO_PROMPT[n]) == expected[str(n)], f"{arch}, prompt length {n}"
        # Every full block of both prompts was read from the prefill node over NIXL, and checked on landing.
        assert transfer(decode) == (5 * one_block, 0.0)
        before = {u: work(u) for u in (prefill, decode)}
        assert complete(c.url, EXTENDED) == expected["extended"], f"{arch}, extended prompt"
        assert transfer(decode) == (6 * one_block, 0.0)
        # (tokens from cache, tokens computed). The decode node counts its held and its pulled blocks as cached,
        # and computes the 8-token tail and the first token, which came from the prefill node without its KV.
        grew = {u: tuple(a - b for a, b in zip(work(u), before[u], strict=True)) for u in (prefill, decode)}
        assert grew == {prefill: (64, 24), decode: (80, 9)}
        assert metrics(decode)['kvrelay_kv_integrity_checks_total{where="nixl_read"}'] == 6 * groups
        assert integrity_failures(decode) == 0
        wait_for(lambda: idle(c), what="leases released and pools idle")


def tier_hits(url: str) -> dict[str, float]:
    """Blocks a node's prefix lookups found so far, by tier."""
    m = metrics(url)
    return {t: m.get(f'kvrelay_prefix_cache_hits_total{{tier="{t}"}}', 0.0) for t in ("device", "host", "disk")}


class Served(NamedTuple):
    """One request's tokens and what it did: on the prefill node, the blocks its prefix lookup found by tier
    and the prompt tokens it took from cache; the blocks the decode node pulled."""

    tokens: list[int]
    tier_to_blocks: dict[str, float]
    hit_tokens: float
    pulled_blocks: float


@pytest.mark.parametrize("arch", ["gpt-oss", "deepseek-v3"])
def test_prefix_hits_from_host_and_disk_equal_the_cold_tokens(family, arch):
    """A long prompt (4 full blocks) cold, then from the prefill node's host tier, then from its disk tier;
    each time the decode node pulls the 4 blocks the prefill node loaded, and decodes from them. gpt-oss pages
    its full and sliding layers in blocks of their own; DeepSeek-V3's blocks hold one latent row per token and
    layer.

    8 device and 8 host blocks on each node, LRU in every tier: one filler of 7 full blocks (+ a tail: 8 device
    blocks) pushes every cached device block to host; three more overflow the host, oldest (the prompt's) first,
    on to disk."""
    path, expected = family(arch)
    one_block, groups = block_shape(path)  # gpt-oss: 2 pool blocks (full layers, sliding layers) per 16 tokens
    lru = {"policy": "lru"}
    overrides = {"kvstore": {"integrity": "all", "device": {"bytes": 8 * one_block, **lru},
                             "host": {"bytes": 8 * one_block, **lru}, "disk": lru}}
    prompt = LENGTH_TO_PROMPT[LONG]
    fillers = [[(7 * i + j) % 256 for j in range(7 * BLOCK_TOKENS + 1)] for i in range(1, 5)]
    with Cluster(path, overrides=overrides) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]

        def filler(p: list[int]) -> None:
            code, body = post(c.url, {"model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0})
            assert code == 200, body
            wait_for(lambda: idle(c), what="pools idle")

        def serve(p: list[int]) -> Served:
            tiers, hit_tokens, pulled = tier_hits(prefill), prefix_hits(prefill), transfer(decode)[0]
            tokens = complete(c.url, p)
            wait_for(lambda: idle(c), what="pools idle")
            after = tier_hits(prefill)
            return Served(tokens, {t: after[t] - tiers[t] for t in after}, prefix_hits(prefill) - hit_tokens,
                          (transfer(decode)[0] - pulled) / one_block)

        cold = serve(prompt)
        assert cold == Served(expected[str(LONG)], {"device": 0, "host": 0, "disk": 0}, 0, 4)
        filler(fillers[0])
        assert serve(prompt) == Served(cold.tokens, {"device": 0, "host": 4 * groups, "disk": 0}, 4 * BLOCK_TOKENS, 4)
        for p in fillers[1:]:
            filler(p)
        assert serve(prompt) == Served(cold.tokens, {"device": 0, "host": 0, "disk": 4 * groups}, 4 * BLOCK_TOKENS, 4)
        assert integrity_failures(prefill) == 0 and integrity_failures(decode) == 0
        assert transfer(decode)[1] == 0
        if arch == "gpt-oss":
            assert node_info(c, decode)["kv_block_groups"] == [{"layers": [1, 3], "window": None},
                                                               {"layers": [0, 2], "window": 32}]
        else:  # 4 layers × one latent row of 32 + 8 float32 values × 16 tokens
            assert one_block == 4 * (32 + 8) * 4 * BLOCK_TOKENS


def node_info(c: Cluster, url: str) -> dict:
    """A node's ``/info`` (msgpack, behind the internal token)."""
    import urllib.request

    import msgpack
    from kvrelay.transfer.config import TOKEN_HEADER

    req = urllib.request.Request(url + "/info", headers={TOKEN_HEADER: c.token})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return msgpack.unpackb(resp.read())


def test_gpt_oss_mixed_lengths_sent_together_equal_one_by_one(family):
    path, expected = family("gpt-oss")
    prompts = [LENGTH_TO_PROMPT[n] for n in LENGTHS]
    with Cluster(path) as c:
        with ThreadPoolExecutor(len(prompts)) as pool:  # cold, and in flight together
            together = list(pool.map(lambda p: complete(c.url, p), prompts))
        one_by_one = [complete(c.url, p) for p in prompts]  # prefix hits now, on both nodes
        wait_for(lambda: idle(c), what="leases released and pools idle")
    for n, both, one in zip(LENGTHS, together, one_by_one, strict=True):
        assert both == expected[str(n)], f"prompt length {n}, sent together"
        assert one == expected[str(n)], f"prompt length {n}, one by one"
