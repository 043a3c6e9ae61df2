"""``kvrelay bench prefill``: how fast prompts become KV, against the machine's own matmul rate and against peers.

Issue 33's measurement, in one run, per prompt length (default 512, 2,048 and 8,192 tokens; random token ids, a
fresh prompt every time so no cache helps):

* **kvrelay in process**: `engine.LLMEngine` with prefix caching off, one prompt, ``max_tokens=1``; the time
  from `add_request` to the first token (chunked by ``--max-num-batched-tokens``, the engine's default).
* **the limit**: the prompt's FLOPs (`prefill_flops`: the linear layers, ``2 · tokens · weights``, plus
  attention, ``4 · layers · heads · head_dim · Σ context``; the head on the last row only) over the matmul rate
  measured in the same run at the model's own shapes (`matmul_rate`: each layer's ``[chunk, in] × [in, out]``
  products, the chunk rows the engine uses, same dtype and threads). ``utilisation = flops / ttft / rate``.
* **transformers** (``--transformers``): ``AutoModelForCausalLM`` in the same dtype, one forward of the whole
  prompt (its default attention), timed the same way.
* **served** (``--serve``): the default deployment (``kvrelay up``, `deploy/configs/local.yaml`: 1P1D) and, with
  ``--peer-script``, vLLM's CPU build (in kvrelay's dtype unless ``--vllm-args`` says otherwise), each sent
  the prompt as ``/v1/completions`` with ``max_tokens: 1``;
  the time to the whole answer (one token: its TTFT).

Each figure is the median of ``--repeats`` fresh prompts after one warm-up. JSON on stdout.

    kvrelay bench prefill --model .models/smollm2-135m-instruct --transformers --serve
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from kvrelay.benchmarks.common import emit, machine_label, seeded_prompt
from kvrelay.benchmarks.kernel_bench import prefill_flops as kernel_prefill_flops
from kvrelay.model.config import ModelConfig

DEFAULT_LENGTHS = (512, 2048, 8192)


def prefill_flops(cfg: ModelConfig, tokens: int, *, cached: int = 0) -> dict[str, float]:
    """FLOPs to prefill ``tokens`` new tokens after ``cached`` ones (a dense model; multiply-adds count 2):
    ``linear`` (q/k/v/o and the MLP for every token, the head for the last), ``attention`` (QKᵀ and PV over each
    token's causal context) and ``total``."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    linear = 2.0 * tokens * per_token * cfg.num_hidden_layers + 2.0 * h * cfg.vocab_size
    heads = {"num_q_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim}
    attention = float(cfg.num_hidden_layers * kernel_prefill_flops(1, cached, tokens, heads))
    return {"linear": linear, "attention": attention, "total": linear + attention}


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """``(in, out)`` of one layer's matmuls as the engine runs them (q/k/v fused, gate/up fused)."""
    h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def matmul_rate(cfg: ModelConfig, *, rows: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """FLOP/s of one layer's matmuls at ``rows`` rows (`layer_shapes`), looped for about ``seconds``, best of
    3 loops: what the linear layers of a prefill chunk could reach on this machine, now."""
    weights = [torch.randn(out, inp, dtype=dtype) * 0.02 for inp, out in layer_shapes(cfg)]
    xs = [torch.randn(rows, inp, dtype=dtype) for inp, _ in layer_shapes(cfg)]
    flops = sum(2.0 * rows * w.shape[0] * w.shape[1] for w in weights)

    def once() -> None:
        for x, w in zip(xs, weights, strict=True):
            F.linear(x, w)

    once()
    t0 = time.perf_counter()
    once()
    loops = max(1, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(loops):
            once()
        best = min(best, (time.perf_counter() - t0) / loops)
    return flops / best


def _median_time(run: Callable[[list[int]], None], prompts: Sequence[list[int]]) -> float:
    """``run`` on ``prompts[0]`` as a warm-up, then the median seconds over the rest."""
    run(prompts[0])
    times = []
    for prompt in prompts[1:]:
        t0 = time.perf_counter()
        run(prompt)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_ttft(model_dir: str, prompts: Sequence[list[int]], *, dtype: str, max_num_batched_tokens: int) -> float:
    """Median seconds from `add_request` to the first token in an in-process engine, prefix caching off."""
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.model.loader import load_model
    from kvrelay.model.sampling import SamplingParams

    loaded = load_model(model_dir, dtype=dtype)
    longest = max(len(p) for p in prompts)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=-(-longest // 16) + 8, enable_prefix_caching=False,
                                            max_num_batched_tokens=max_num_batched_tokens,
                                            max_model_len=longest + 1))
    count = iter(range(1 << 30))

    def run(prompt: list[int]) -> None:
        engine.add_request(f"p{next(count)}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()

    return _median_time(run, prompts)


def transformers_ttft(model_dir: str, prompts: Sequence[list[int]], *, dtype: torch.dtype) -> float:
    """Median seconds of one transformers forward over the whole prompt (its logits for every row)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def run(prompt: list[int]) -> None:
        with torch.inference_mode():
            model(torch.tensor([prompt]), use_cache=True)

    return _median_time(run, prompts)


def served_ttft(url: str, model_name: str, prompts: Sequence[list[int]]) -> float:
    """Median seconds of a ``/v1/completions`` request for one token of each prompt (token ids)."""

    def run(prompt: list[int]) -> None:
        body = json.dumps({"model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read())
        if answer["usage"]["prompt_tokens"] != len(prompt):
            raise RuntimeError(f"{url} counted {answer['usage']['prompt_tokens']} prompt tokens, not {len(prompt)}")

    return _median_time(run, prompts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay bench prefill", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/smollm2-135m-instruct")
    p.add_argument("--lengths", default=",".join(str(n) for n in DEFAULT_LENGTHS),
                   help="prompt lengths in tokens, comma list (cut to the model's positions - 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed prompts per length (after one warm-up)")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on AMX / AVX512-BF16, float32 elsewhere")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the engine's chunk (its default)")
    p.add_argument("--transformers", action="store_true", help="also time transformers' forward")
    p.add_argument("--serve", action="store_true", help="also time the default deployment (kvrelay up) over HTTP")
    p.add_argument("--peer-script", default=None, help="with --serve: vLLM's CPU build (../shared/peers/vllm-cpu.sh)")
    p.add_argument("--vllm-args", default=None,
                   help="vLLM's own flags (default: --dtype of the dtype kvrelay runs here, so both compute alike; "
                        "the peer script's bf16 is ~100x slower than float32 on a CPU without AVX512-BF16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    from kvrelay.model.dtype import resolve_dtype

    p = build_parser()
    a = p.parse_args(argv)
    config_path = Path(a.model) / "config.json"
    if not config_path.is_file():
        p.error(f"--model {a.model} is not a model directory")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    cfg = ModelConfig.from_hf_dict(json.loads(config_path.read_text()))
    if cfg.moe is not None:
        p.error("--model: a mixture-of-experts model; prefill_flops counts dense layers only")
    lengths = [min(int(x), cfg.max_position_embeddings - 1) for x in a.lengths.split(",")]
    dtype_name = resolve_dtype(a.dtype, "cpu")
    dtype = getattr(torch, dtype_name)
    rng = random.Random(a.seed)
    prompts = {n: [seeded_prompt(rng, n, cfg.vocab_size) for _ in range(a.repeats + 1)] for n in lengths}
    rate = matmul_rate(cfg, rows=a.max_num_batched_tokens, dtype=dtype)
    rows: dict[int, dict[str, Any]] = {}
    for n in lengths:
        flops = prefill_flops(cfg, n)
        ttft = engine_ttft(a.model, prompts[n], dtype=dtype_name, max_num_batched_tokens=a.max_num_batched_tokens)
        rows[n] = {"flops": flops, "limit_s": flops["total"] / rate, "kvrelay_engine_s": ttft,
                   "kvrelay_engine_tok_s": n / ttft, "utilisation": flops["total"] / ttft / rate}
        if a.transformers:
            hf = transformers_ttft(a.model, prompts[n], dtype=dtype)
            rows[n].update(transformers_s=hf, engine_over_transformers=ttft / hf)
    vllm_args: list[str] | None = None
    if a.serve:
        from kvrelay.benchmarks.deployment import Deployment

        with Deployment(a.model, overrides={"model": {"dtype": a.dtype}}) as d:
            for n in lengths:
                rows[n]["kvrelay_1p1d_s"] = served_ttft(d.url, d.model_name, prompts[n])
        if a.peer_script:
            from kvrelay.benchmarks.peer import PeerServer

            vllm_args = shlex.split(a.vllm_args) if a.vllm_args is not None else ["--dtype", dtype_name]
            with PeerServer(a.peer_script, a.model, extra_args=vllm_args) as peer:
                name = json.loads(urllib.request.urlopen(peer.url + "/v1/models", timeout=30).read())["data"][0]["id"]
                for n in lengths:
                    rows[n]["vllm_s"] = served_ttft(peer.url, name, prompts[n])
                    rows[n]["kvrelay_1p1d_over_vllm"] = rows[n]["kvrelay_1p1d_s"] / rows[n]["vllm_s"]
    emit({"bench": "prefill", "model": a.model, "dtype": dtype_name, "torch_threads": torch.get_num_threads(),
          "max_num_batched_tokens": a.max_num_batched_tokens, "matmul_flop_s": rate, "repeats": a.repeats,
          **({"vllm_args": vllm_args} if vllm_args is not None else {}),
          "lengths": {str(n): row for n, row in rows.items()}, **machine_label()}, a.out)
    return 0
