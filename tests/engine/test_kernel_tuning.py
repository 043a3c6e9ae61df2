"""`engine.kernel_tuning`: the CPU's identity, plans measured on the model's own shapes, kept per key and read back,
one measurement for processes that start at once, and the modes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvrelay.engine import kernel_tuning
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.kernel_tuning import best_us, fastest, plan_for
from kvrelay.model.attention import TorchBackend
from kvrelay.model.cpu_identity import this_cpu
from kvrelay.model.kernel_paths import linear_kernels
from kvrelay.model.kernel_plan import LINEAR_KINDS, ROW_BUCKETS, KernelPlan, builtin_plan
from kvrelay.model.loader import load_model


def test_best_and_fastest() -> None:
    calls: list[str] = []
    result = best_us({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # one warm-up each, then the order turned each round
    assert set(result) == {"a", "b"} and all(t >= 0 for t in result.values())
    assert fastest({"x": 3.0, "y": 1.5, "z": 1.5}) == "y"


def _pool_and_backend(loaded) -> tuple[torch.Tensor, TorchBackend]:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=32, kernel_plan="builtin"))
    return engine.kv_pool, engine.runner.backend


def test_a_measured_plan_times_every_candidate(tiny_model_dir, tmp_path) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    pool, backend = _pool_and_backend(loaded)
    loaded.model.kernel_plan = None  # measure on the same model: every copy is still there (builtin keeps them)
    plan = plan_for(loaded.model, pool, backend, mode="measure", cache_dir=tmp_path)
    assert plan.source == "measured" and plan.cpu == this_cpu().kernel_label
    kernels = linear_kernels(loaded.model)
    want = set()
    for kind in LINEAR_KINDS:
        for bucket, rows in enumerate(ROW_BUCKETS):
            paths = ("onednn", "torch") if bucket == len(ROW_BUCKETS) - 1 else ("blocked", "onednn", "torch")
            want |= {f"linear.{kind}.{rows}.{p}" for p in paths if kernels[kind][0].can_take(p)}
    if backend.cpu_decode_kernels is not None:
        want |= {f"{name}.{p}" for name in ("prefill_attention", "decode_attention") for p in ("cpp", "torch")}
        want |= {f"stack.{rows}.{p}" for rows in ROW_BUCKETS[:5] for p in ("stack", "layers")}
    assert set(plan.timings_us) == want
    for kind in LINEAR_KINDS:  # each bucket's choice is its fastest candidate
        for bucket, rows in enumerate(ROW_BUCKETS):
            times = {p: t for k, t in plan.timings_us.items() if k.startswith(f"linear.{kind}.{rows}.")
                     for p in [k.rsplit(".", 1)[1]]}
            assert plan.linear[kind][bucket] == fastest(times)
    for bucket, rows in enumerate(ROW_BUCKETS[:5]):
        if backend.cpu_decode_kernels is not None:
            stack, layers = plan.timings_us[f"stack.{rows}.stack"], plan.timings_us[f"stack.{rows}.layers"]
            assert plan.stack[bucket] == (stack <= layers)


def test_auto_measures_once_and_reads_the_plan_back(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kernel_tuning, "MIN_CPU_SHARE", 0.0)  # kept however busy the machine is
    loaded = load_model(tiny_model_dir, dtype="float32")
    pool, backend = _pool_and_backend(loaded)
    measured: list[KernelPlan] = []
    real = kernel_tuning.measure
    monkeypatch.setattr(kernel_tuning, "measure", lambda *a, **k: measured.append(real(*a, **k)) or measured[-1])
    first = plan_for(loaded.model, pool, backend, cache_dir=tmp_path)
    second = plan_for(loaded.model, pool, backend, cache_dir=tmp_path)
    assert len(measured) == 1 and first.source == "measured" and second.source == "cached"
    assert second == KernelPlan.from_json(first.to_json())
    stored = list(tmp_path.glob("*.json"))
    key = kernel_tuning.plan_key(loaded.model, pool, cpu=this_cpu().kernel_label)
    assert len(stored) == 1 and stored[0].stem == key
    # another kernel variant loaded on the same CPU (a wheel without its best one): another plan
    kernels = kernel_tuning.CPU_KERNELS
    kernels.load()
    with monkeypatch.context() as m:
        m.setattr(kernels, "variant", "avx2" if kernels.variant == "base" else "base")
        assert kernel_tuning.plan_key(loaded.model, pool, cpu=this_cpu().kernel_label) != key
    stored[0].write_text("{half a plan")  # unreadable: measured again and stored whole
    third = plan_for(loaded.model, pool, backend, cache_dir=tmp_path)
    assert len(measured) == 2 and third.source == "measured"
    assert KernelPlan.from_json(stored[0].read_text()).linear == third.linear
    assert plan_for(loaded.model, pool, backend, mode="measure", cache_dir=tmp_path).source == "measured"
    assert len(measured) == 3
    assert plan_for(loaded.model, pool, backend, mode="builtin", cache_dir=tmp_path) == builtin_plan(packed=False)
    assert len(measured) == 3
    with pytest.raises(ValueError, match="kernel_plan must be one of auto, measure, builtin; got 'fast'"):
        plan_for(loaded.model, pool, backend, mode="fast", cache_dir=tmp_path)


def test_a_plan_measured_while_preempted_is_not_kept(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kernel_tuning, "MIN_CPU_SHARE", 1.5)  # no thread runs more than all the time: "preempted"
    loaded = load_model(tiny_model_dir, dtype="float32")
    pool, backend = _pool_and_backend(loaded)
    assert [plan_for(loaded.model, pool, backend, cache_dir=tmp_path).source for _ in range(2)] == ["measured"] * 2
    assert list(tmp_path.glob("*.json")) == []


def test_engine_config_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="kernel_plan must be one of auto, measure, builtin, got 'always'"):
        EngineConfig(kernel_plan="always")


RACER = """
import sys
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine import kernel_tuning
from kvrelay.engine.kernel_tuning import plan_for
from kvrelay.model.kernel_paths import linear_kernels
from kvrelay.model.loader import load_model
from pathlib import Path
kernel_tuning.MIN_CPU_SHARE = 0.0  # kept however busy the machine is
loaded = load_model(sys.argv[1], dtype="bfloat16")
engine = LLMEngine(loaded, EngineConfig(num_blocks=32, kernel_plan="builtin"))
loaded.model.kernel_plan = None
plan = plan_for(loaded.model, engine.kv_pool, engine.runner.backend, cache_dir=Path(sys.argv[2]))
print(plan.source, plan.to_json().replace(plan.source, "-"))
"""


def test_processes_starting_at_once_measure_once(tiny_model_dir, tmp_path) -> None:
    """Two processes on one cache: one measures, the other waits on the lock and reads its plan."""
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tiny_model_dir), str(tmp_path)], cwd=root,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].split(" ", 1) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted(o[0] for o in outs) == ["cached", "measured"]
    assert outs[0][1] == outs[1][1]  # the same plan, timings and all


def test_the_config_key_offers_exactly_the_engine_s_modes() -> None:
    """`deploy.config_keys` spells the modes itself (the router loads it without torch): the same ones."""
    from kvrelay.deploy.config_keys import KEYS

    key = KEYS["engine.kernel_plan"]
    assert key.check.allowed == ", ".join(kernel_tuning.PLAN_MODES) and key.default == EngineConfig().kernel_plan
    assert [key.check(mode) for mode in kernel_tuning.PLAN_MODES] == list(kernel_tuning.PLAN_MODES)
    with pytest.raises(ValueError, match="is not one of"):
        key.check("sometimes")
