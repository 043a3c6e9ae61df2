"""``dtype: auto``: bf16 where the hardware computes it natively, fp32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.dtype import cpu_flags, resolve_dtype
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams


@pytest.mark.parametrize(("flags", "want"), [
    ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
    ({"avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "avx512f", "fma"}, "float32"),
    (set(), "float32"),
])
def test_auto_on_cpu_follows_the_bf16_flags(flags: set[str], want: str) -> None:
    assert resolve_dtype("auto", "cpu", flags=frozenset(flags)) == want


def test_auto_on_cuda_is_bf16_and_names_pass_through() -> None:
    assert resolve_dtype("auto", "cuda", flags=frozenset()) == "bfloat16"
    assert resolve_dtype("float32", "cuda") == "float32"
    with pytest.raises(ValueError, match="dtype 'fp8' is not supported; use one of \\['auto', 'bfloat16'"):
        resolve_dtype("fp8", "cpu")


def test_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16 amx_tile\nbugs\t: x\n")
    assert cpu_flags(info) == frozenset({"fpu", "sse2", "avx512_bf16", "amx_tile"})
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_kv_dtype_can_differ_from_the_weights(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64, kv_dtype="bfloat16"))
    assert engine.spec.dtype == "bfloat16" and engine.kv_pool.dtype == torch.bfloat16
    [[tokens]] = engine.generate([list(range(1, 40))], SamplingParams(max_tokens=8))
    assert len(tokens) == 8
    auto = load_model(tiny_model_dir, dtype="auto")
    assert next(auto.model.parameters()).dtype == getattr(torch, resolve_dtype("auto", "cpu"))
