"""Issue 28: the first benchmark a user runs. vLLM's `bench serve` shape — random prompts of 256 tokens,
64 tokens out with ``ignore_eos``, streaming, a fixed concurrency — through an equivalent client
(`benchmarks.serve_client`: vLLM's definitions) against a 1P1D deployment, at its default KV sizing and with
a deliberately small pool. Every request completes with all its tokens, and no lease outlives its request
by more than a second. The default run covers the real model at its default sizing (concurrency 16) and the
tiny model with a small pool (64 and 256); the other combinations are marked slow."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from kvrelay.benchmarks.serve_client import ClientConfig, LoadConfig, RequestSpec, run_load
from kvrelay.model.dtype import DTYPE_NAME_TO_TORCH, resolve_dtype

from tests.services.cluster import Cluster, get_json
from tests.services.test_faults import wait_for

DEFAULT_KV = {"kvstore": {"device": {"bytes": None}, "host": {"bytes": None, "fraction_of_free": 0.1}}}
# A request's deadline past the Cluster's 60 s: every request must complete, and on a shared 2-core machine a
# 256-token prefill of the real model queued behind 15 others can take longer than that.
NO_TIMEOUT = {"router": {"request_timeout_s": 600}}


def small_kv(block_bytes: int, blocks: int = 182) -> dict[str, Any]:
    """A pool of ``blocks`` blocks per node: 182 is what 64 MiB holds of SmolLM2-135M's KV (~2,900 tokens)."""
    return {"kvstore": {"device": {"bytes": blocks * block_bytes}}}


def run_bench_serve(c: Cluster, *, vocab: int, concurrency: int, num_prompts: int, seed: int) -> None:
    rng = random.Random(seed)
    specs = [RequestSpec(tuple(rng.randrange(vocab) for _ in range(256)), 64) for _ in range(num_prompts)]
    result = asyncio.run(run_load(ClientConfig(c.url, c.model_name, timeout_s=600), specs,
                                  LoadConfig(max_concurrency=concurrency, progress=False)))
    done = time.monotonic()
    failed = [r.error for r in result.records if not r.success]
    assert failed == [], failed[:3]
    assert [r.num_output_tokens for r in result.records] == [64] * num_prompts
    for prefill in c.prefill_urls:  # a lease ends with its request (a pulled handle: the reader's "done")
        wait_for(lambda url=prefill: get_json(url + "/health")["leases"] == 0, 1.0, "the last lease to end")
    assert time.monotonic() - done < 1.5
    wait_for(lambda: all(get_json(u + "/health")["in_use_blocks"] == 0 for u in c.prefill_urls + c.decode_urls),
             10.0, "the pools to be idle")
    router = get_json(c.url + "/health")
    assert (router["queued"], router["admitted"]) == (0, 0)
    assert all(n["reserved_blocks"] == 0 and n["reserved_seqs"] == 0 for n in router["nodes"].values())


def block_bytes_of(model_dir: Path, itemsize: int) -> int:
    """Bytes of one 16-token KV block of the model (2 · layers · KV heads · 16 · head size · itemsize)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 16 * head_dim * itemsize


@pytest.mark.parametrize("kv", ["default", pytest.param("small", marks=pytest.mark.slow)])
def test_bench_serve_at_concurrency_16_on_the_real_model(smollm2, kv):
    itemsize = DTYPE_NAME_TO_TORCH[resolve_dtype("auto", "cpu")].itemsize  # bf16 with AMX / AVX512-BF16, else fp32
    block_bytes = block_bytes_of(smollm2.model_dir, itemsize)
    overrides = {"model": {"name": "smollm2", "dtype": "auto"},  # as `make serve` runs it
                 **(DEFAULT_KV if kv == "default" else small_kv(block_bytes)), **NO_TIMEOUT}
    with Cluster(smollm2.model_dir, overrides=overrides) as c:
        health = get_json(c.decode_urls[0] + "/health")
        assert health["kv_bytes"]["block"] == block_bytes
        if kv == "default":  # 0.2 of the node's share of the host memory free at start (what `kvrelay up` passed)
            cmdline = Path(f"/proc/{health['pid']}/cmdline").read_bytes().split(b"\0")
            budget = int(cmdline[cmdline.index(b"--memory-budget") + 1])
            assert health["total_blocks"] == int(budget * 0.2) // block_bytes
            assert health["kv_bytes"]["host"] == int(budget * 0.1) // block_bytes * block_bytes
            assert health["total_blocks"] >= 64 * 20  # 64 sequences of the bench (320 tokens each) at once
        else:
            assert health["total_blocks"] == 182
        # Two waves of 16: every slot is handed back (lease, blocks, reservation) and reused. More waves only
        # add the real model's CPU time (its 256-token prefills); the tiny model's test runs 64 and 256 prompts.
        run_bench_serve(c, vocab=49152, concurrency=16, num_prompts=32, seed=16)


@pytest.mark.parametrize("kv", [pytest.param("default", marks=pytest.mark.slow), "small"])
def test_bench_serve_at_concurrency_64_and_256_on_the_tiny_model(tiny_model_dir, kv):
    overrides = {**(DEFAULT_KV if kv == "default" else small_kv(block_bytes_of(tiny_model_dir, 4))), **NO_TIMEOUT}
    with Cluster(tiny_model_dir, overrides=overrides) as c:
        run_bench_serve(c, vocab=258, concurrency=64, num_prompts=64, seed=64)
        run_bench_serve(c, vocab=258, concurrency=256, num_prompts=256, seed=256)


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [64, 256])
def test_bench_serve_at_high_concurrency_on_the_real_model(smollm2, concurrency):
    overrides = {"model": {"name": "smollm2", "dtype": "bfloat16"}, **small_kv(block_bytes_of(smollm2.model_dir, 2)),
                 **NO_TIMEOUT}
    with Cluster(smollm2.model_dir, overrides=overrides) as c:
        run_bench_serve(c, vocab=49152, concurrency=concurrency, num_prompts=max(64, concurrency), seed=concurrency)
