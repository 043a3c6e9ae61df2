"""The engine through the Triton kernels on the CPU (issue 19): `kvrelay generate` and a `kvrelay up` request
with ``attention_backend: triton`` give exactly the reference backend's tokens (greedy, float32, tiny model),
so the code a GPU runs is exercised end to end here, under Triton's interpreter."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import urllib.request

import msgpack
import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.transfer.config import TOKEN_HEADER

from tests.services.cluster import Cluster
from tests.services.test_faults import post

PROMPTS = [[random.Random(s).randrange(256) for _ in range(n)] for s, n in ((1, 37), (2, 70), (3, 5))]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _reference(model_dir) -> list[list[int]]:
    engine = LLMEngine(load_model(model_dir), EngineConfig(num_blocks=64, attention_backend="reference"))
    return [o[0] for o in engine.generate(PROMPTS, PARAMS)]


def test_generate_with_the_triton_backend_gives_the_reference_tokens(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command sets it itself
    # One command per prompt, all started at once (each spends most of its time importing); the reference is
    # computed here meanwhile.
    runs = [subprocess.Popen(
        [sys.executable, "-m", "kvrelay.deploy.cli", "generate", "--model", str(tiny_model_dir), "--prompt-ids",
         ",".join(map(str, prompt)), "--max-tokens", "8", "--dtype", "float32", "--attention-backend", "triton",
         "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for prompt in PROMPTS]
    try:
        want = _reference(tiny_model_dir)
        for proc, tokens in zip(runs, want, strict=True):
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-2000:]
            got = json.loads(stdout)
            assert (got["token_ids"], got["attention_backend"]) == (tokens, "triton")
    finally:
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_batched_engine_step_through_triton_matches_the_reference(tiny_model_dir):
    """Prefill chunks (with a cached prefix: the third prompt repeats the first's start) and decodes batched."""
    prompts = [*PROMPTS, PROMPTS[0][:32] + [7, 7, 7]]
    ref = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=64, attention_backend="reference"))
    tri = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=64, attention_backend="triton",
                                                             max_num_batched_tokens=48))
    backend = tri.runner.backend
    calls = {"mixed": 0, "decode": 0}
    unified, decode = backend.unified_attention, backend.paged_decode_attention

    def count(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapped

    backend.unified_attention = count("mixed", unified)  # steps with prefill and decode tokens: one launch
    backend.paged_decode_attention = count("decode", decode)  # decode-only steps: the split-K kernel
    assert [o[0] for o in tri.generate(prompts, PARAMS)] == [o[0] for o in ref.generate(prompts, PARAMS)]
    num_layers = tri.spec.num_layers
    assert calls["mixed"] >= num_layers and calls["mixed"] % num_layers == 0
    assert calls["decode"] >= num_layers
    assert tri.scheduler.num_prefix_hit_tokens >= 32  # the fourth prompt reused the first's two blocks


@pytest.mark.parametrize("policy", [
    # offloaded KV recalled in steps that mix prefill chunks and decodes: the unified path with a KvHook
    LongContextConfig("infinigen", device_budget_tokens=128, sink_tokens=16, recent_tokens=32, recall_blocks=4),
    # token weights: the separate prefill and decode kernels (the unified path does not take them)
    LongContextConfig("h2o", device_budget_tokens=96, sink_tokens=16, recent_tokens=32),
], ids=["infinigen", "h2o"])
def test_long_context_policies_through_triton_match_the_reference(tiny_model_dir, policy):
    prompts = [[random.Random(11 + i).randrange(256) for _ in range(n)] for i, n in enumerate((100, 90, 20))]
    params = SamplingParams(max_tokens=27, ignore_eos=True)
    store = TieredStoreConfig(num_device_blocks=96, num_host_blocks=64, watermark_blocks=0)

    def run(backend: str) -> tuple[list[list[int]], LLMEngine]:
        eng = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=96, long_context=policy,
                                                                 attention_backend=backend, max_num_batched_tokens=32),
                        store_config=store)
        return [o[0] for o in eng.generate(prompts, params)], eng

    want, _ = run("reference")
    got, eng = run("triton")
    assert got == want
    stats = eng.policies.stats
    assert (stats.recalled_layer_blocks if policy.policy == "infinigen" else stats.evicted_tokens) > 0


def test_a_kvrelay_up_request_through_triton_gives_the_reference_tokens(tiny_model_dir):
    want = _reference(tiny_model_dir)[1]
    overrides = {"engine": {"attention_backend": "triton"}}
    # Not set for the nodes: each must turn Triton's interpreter on itself (deploy.serve.use_triton_interpreter).
    with Cluster(tiny_model_dir, overrides=overrides, env={"TRITON_INTERPRET": ""}) as c:
        code, out = post(c.url, {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True})
        assert code == 200, out
        for url in c.prefill_urls + c.decode_urls:
            req = urllib.request.Request(url + "/info", headers={TOKEN_HEADER: c.token})
            with urllib.request.urlopen(req, timeout=5) as resp:
                info = msgpack.unpackb(resp.read())
            assert info["attention_backend"] == "triton"
    assert out["choices"][0]["text"] == load_tokenizer(tiny_model_dir).decode(want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_engine_gives_the_cpu_reference_tokens(tiny_model_dir):
    """On CUDA (compiled Triton kernels, device pool, KV digests by the Triton kernel): float32 greedy tokens equal
    the CPU reference backend's, for a batch mixing long and short prompts and a shared prefix."""
    prompts = [*PROMPTS, PROMPTS[0][:32] + [7, 7, 7]]
    gpu = LLMEngine(load_model(tiny_model_dir, dtype="float32", device="cuda"),
                    EngineConfig(num_blocks=64, attention_backend="triton", max_num_batched_tokens=48))
    assert gpu.kv_pool.device.type == "cuda"
    assert [o[0] for o in gpu.generate(prompts, PARAMS)] == [
        o[0] for o in LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=64, attention_backend="reference"))
        .generate(prompts, PARAMS)]
