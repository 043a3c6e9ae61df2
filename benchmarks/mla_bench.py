"""``kvrelay bench mla``: what multi-head latent attention (DeepSeek-V2/V3) saves, in one run.

* **KV bytes per token**, from the block layout the engine builds (`engine.kv_layout.kv_block_spec`), for
  DeepSeek-V3's published shapes (61 layers, a 512 + 64 latent, bf16) against GQA models of the same hidden size
  and depth: 8 KV heads of 128 (Llama-3-70B's ratio) and every head its own K and V (multi-head).
* **1P1D transfer bytes per request**, measured: one ``kvrelay up`` (1 prefill + 1 decode node) per model, tiny
  DeepSeek-V3 and a tiny Llama of the same hidden size, depth and heads (2 KV heads), the same 90-token prompt;
  the bytes the decode node read over NIXL (``kvrelay_kv_transfer_bytes_total``). Each deployment has its own
  fresh disk tier.
* **Absorbed against unabsorbed attention on this CPU**: one `model.deepseek.MlaAttention` layer with
  DeepSeek-V3's per-head shapes (latent 512 + 64, nope 128, v 128; 16 heads, hidden 2048, random weights,
  float32): the median time of a decode step (batch 1 and 8 over 1k and 4k cached tokens) and of a cold prefill
  (512 and 2,048 tokens), attending in latent space against expanding every cached latent to keys and values
  (transformers' way: decode through `kernels.reference.mla_unabsorbed_attention`, prefill through fused SDPA).
  The engine decodes absorbed and prefills unabsorbed (each row's ``engine_default``), from these figures.

    kvrelay bench mla [--out bench-out/mla.json] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from kvrelay.benchmarks.common import emit, machine_label

V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
          num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
          qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
          moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3, max_position_embeddings=163840,
          rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
PROMPT_TOKENS = 90  # 5 full 16-token blocks and a 10-token tail


def kv_bytes_per_token() -> dict[str, Any]:
    from kvrelay.engine.kv_layout import kv_block_spec
    from kvrelay.model.config import ModelConfig

    def per_token(config: dict) -> int:
        spec = kv_block_spec(ModelConfig.from_hf_dict(config), fingerprint="", block_size_tokens=16, dtype="bfloat16")
        return spec.token_bytes

    dense = dict(model_type="llama", vocab_size=V3["vocab_size"], hidden_size=V3["hidden_size"],
                 intermediate_size=V3["intermediate_size"], num_hidden_layers=V3["num_hidden_layers"],
                 num_attention_heads=V3["hidden_size"] // 128, head_dim=128)
    mla = per_token(V3)
    gqa = per_token({**dense, "num_key_value_heads": 8})
    mha = per_token({**dense, "num_key_value_heads": dense["num_attention_heads"]})
    return {"deepseek_v3_bytes": mla, "gqa_8kv_bytes": gqa, "mha_bytes": mha,
            "deepseek_vs_gqa": round(mla / gqa, 3), "deepseek_vs_mha": round(mla / mha, 3),
            "latent_ratio_vs_gqa": round((512 + 64) / (2 * 8 * 128), 3)}


def transfer_bytes_per_request() -> dict[str, Any]:
    import json
    import random
    import urllib.request

    from kvrelay.benchmarks.deployment import Deployment, get_text
    from kvrelay.benchmarks.serve_metrics import parse_prometheus
    from kvrelay.model.tiny import write_tiny_model

    prompt = [random.Random(35).randrange(256) for _ in range(PROMPT_TOKENS)]
    out: dict[str, Any] = {"prompt_tokens": PROMPT_TOKENS}
    with tempfile.TemporaryDirectory(prefix="kvrelay-mla-") as tmp:
        for arch in ("deepseek-v3", "llama"):
            model = write_tiny_model(Path(tmp) / arch, arch=arch, layers=4, heads=4, kv_heads=2)
            with Deployment(model, overrides={"kvstore": {"disk": {"bytes": "64MiB"}}}) as d:
                body = json.dumps({"model": d.model_name, "prompt": prompt, "max_tokens": 4}).encode()
                req = urllib.request.Request(d.url + "/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as resp:
                    assert resp.status == 200
                moved = parse_prometheus(get_text(d.decode_urls[0] + "/metrics")).get(
                    "kvrelay_kv_transfer_bytes_total", 0.0)
            out[f"{arch}_bytes"] = moved
    out["deepseek_vs_gqa"] = round(out["deepseek-v3_bytes"] / out["llama_bytes"], 3)
    out["expected_ratio"] = round((32 + 8) / (2 * 2 * 16), 3)  # the tiny models' latent row vs K+V of 2 heads
    return out


def _layer() -> Any:
    from kvrelay.model.config import ModelConfig
    from kvrelay.model.deepseek import MlaAttention

    cfg = ModelConfig.from_hf_dict({**V3, "hidden_size": 2048, "num_attention_heads": 16, "q_lora_rank": 512,
                                    "num_hidden_layers": 1, "n_routed_experts": None})
    torch.manual_seed(0)
    layer = MlaAttention(cfg).eval()
    layer.prepare()
    return cfg, layer


def _time(fn: Any, args: tuple, repeats: int) -> tuple[float, Any]:
    """(median milliseconds of ``fn(*args)`` over ``repeats`` calls after one untimed call, its result)."""
    out = fn(*args)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3, out


def absorbed_vs_unabsorbed(repeats: int) -> list[dict[str, Any]]:
    from kvrelay.model.attention import AttentionBatch, make_backend
    from kvrelay.model.rope import rope_inv_freq, rotary_cos_sin

    cfg, layer = _layer()
    backend = make_backend("torch")
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    rows = []
    empty = torch.zeros(0, 1, dtype=torch.int32)
    cases = [("decode", n, ctx) for n in (1, 8) for ctx in (1024, 4096)] + [("prefill", 1, t) for t in (512, 2048)]
    for kind, batch, tokens in cases:
        bs = 16
        per_seq = -(-(tokens + 1) // bs)
        pool = torch.randn(batch * per_seq, 1, 1, bs, cfg.mla.latent_width) * 0.5
        tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
        if kind == "decode":
            positions = torch.full((batch,), tokens, dtype=torch.int64)
            slots = tables[:, tokens // bs].long() * bs + tokens % bs
            meta = AttentionBatch(
                slot_mapping=slots, num_prefill_tokens=0, prefill_block_tables=empty, prefill_seq_lens=empty[:, 0],
                prefill_query_start_loc=torch.zeros(1, dtype=torch.int32), decode_block_tables=tables,
                decode_seq_lens=torch.full((batch,), tokens + 1, dtype=torch.int32))
        else:
            positions = torch.arange(tokens)
            meta = AttentionBatch(
                slot_mapping=positions.clone(), num_prefill_tokens=tokens, prefill_block_tables=tables,
                prefill_seq_lens=torch.tensor([tokens], dtype=torch.int32),
                prefill_query_start_loc=torch.tensor([0, tokens], dtype=torch.int32), decode_block_tables=empty,
                decode_seq_lens=empty[:, 0])
        x = torch.randn(positions.shape[0], cfg.hidden_size)
        cos_sin = rotary_cos_sin(inv_freq, positions, dtype=torch.float32, scaling=cfg.rope.attention_factor)
        times = {}
        outs = {}
        with torch.inference_mode():
            for absorbed in (True, False):
                layer.absorbed_decode = layer.absorbed_prefill = absorbed
                times[absorbed], outs[absorbed] = _time(layer, (x, cos_sin, pool, meta, backend), repeats)
        rows.append({"step": kind, "batch": batch, "tokens": tokens, "absorbed_ms": round(times[True], 2),
                     "unabsorbed_ms": round(times[False], 2),
                     "absorbed_vs_unabsorbed": round(times[True] / times[False], 3),
                     "engine_default": "absorbed" if kind == "decode" else "unabsorbed",
                     "max_abs_diff": float((outs[True] - outs[False]).abs().max())})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvrelay bench mla", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (median)")
    p.add_argument("--skip-serving", action="store_true", help="leave out the two 1P1D deployments")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    result: dict[str, Any] = {"bench": "mla", **machine_label(), "threads": torch.get_num_threads(),
                              "kv_bytes_per_token": kv_bytes_per_token()}
    if not a.skip_serving:
        result["transfer_1p1d"] = transfer_bytes_per_request()
    result["attention"] = absorbed_vs_unabsorbed(a.repeats)
    emit(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
