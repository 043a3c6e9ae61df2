"""The engine through the Triton kernels on the CPU (issue 19): `kvrelay generate` and a `kvrelay up` request
with ``attention_backend: triton`` give exactly the reference backend's tokens (greedy, float32, tiny model),
so the code a GPU runs is exercised end to end here, under Triton's interpreter."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from model.loader import load_model
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from tests.services.cluster import Cluster
from tests.services.test_faults import post

PROMPTS = [[random.Random(s).randrange(256) for _ in range(n)] for s, n in ((1, 37), (2, 70), (3, 5))]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _reference(model_dir) -> list[list[int]]:
    engine = LLMEngine(load_model(model_dir), EngineConfig(num_blocks=64, attention_backend="reference"))
    return [o[0] for o in engine.generate(PROMPTS, PARAMS)]


def test_generate_with_the_triton_backend_gives_the_reference_tokens(tiny_model_dir):
    want = _reference(tiny_model_dir)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command sets it itself
    for prompt, tokens in zip(PROMPTS, want, strict=True):
        run = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "generate", "--model", str(tiny_model_dir), "--prompt-ids",
             ",".join(map(str, prompt)), "--max-tokens", "8", "--dtype", "float32", "--attention-backend", "triton",
             "--json"], capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads(run.stdout)["token_ids"] == tokens


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


def test_a_kvrelay_up_request_through_triton_gives_the_reference_tokens(tiny_model_dir):
    want = _reference(tiny_model_dir)[1]
    overrides = {"engine": {"attention_backend": "triton"}}
    with Cluster(tiny_model_dir, overrides=overrides, env={"TRITON_INTERPRET": "1"}) as c:
        code, out = post(c.url, {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True})
        assert code == 200, out
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
