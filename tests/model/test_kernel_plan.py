"""`model.kernel_plan`: row buckets, the plan's checks and its stored form; `LinearKernel.use` / `drop_unused`; and
`model.kernel_paths.apply_kernel_plan` (paths taken, copies freed, the same tokens)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.kernels import cpu_small
from kvrelay.model import linear_kernel
from kvrelay.model.kernel_paths import apply_kernel_plan, linear_kernels
from kvrelay.model.kernel_plan import (
    FEW_ROW_BUCKETS,
    LINEAR_KINDS,
    KernelPlan,
    bucket_of,
    builtin_linear_paths,
    builtin_plan,
    deterministic_plan,
)
from kvrelay.model.linear_kernel import LinearKernel, packing_supported
from kvrelay.model.llama import LlamaForCausalLM
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams


def test_bucket_of_each_row_count() -> None:
    got = {rows: bucket_of(rows) for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 1024)}
    assert got == {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 4, 16: 4, 17: 5, 64: 5, 65: 5, 1024: 5}


def test_builtin_plan() -> None:
    assert builtin_linear_paths(packed=True) == ("blocked",) * 5 + ("onednn",)
    assert builtin_linear_paths(packed=False) == ("blocked",) * 5 + ("torch",)
    plan = builtin_plan(packed=False)
    assert plan.stack_rows == tuple(range(1, 17)) and plan.source == "builtin" and plan.timings_us == {}
    assert plan.summary() == {
        "source": "builtin", "cpu": "",
        "linear": {k: {"1": "blocked", "2": "blocked", "4": "blocked", "8": "blocked", "16": "blocked",
                       "17+": "torch"} for k in LINEAR_KINDS},
        "stack_rows": list(range(1, 17)), "prefill_attention": "cpp", "decode_attention": "cpp",
        "deterministic": False}


def test_deterministic_plan() -> None:
    plan = deterministic_plan(stack=True)
    assert plan.linear == dict.fromkeys(LINEAR_KINDS, ("blocked",) * 6) and plan.stack_rows == tuple(range(1, 17))
    assert (plan.source, plan.deterministic, plan.prefill_attention, plan.decode_attention) == (
        "deterministic", True, "cpp", "cpp")
    assert plan.summary()["deterministic"] is True and plan.summary()["linear"]["qkv"]["17+"] == "blocked"
    assert KernelPlan.from_json(plan.to_json(), source="deterministic") == plan
    assert deterministic_plan(stack=False).stack_rows == ()


def _plan(**changes: object) -> KernelPlan:
    return dataclasses.replace(builtin_plan(packed=True), **changes)


@pytest.mark.parametrize(("changes", "message"), [
    ({"linear": {"qkv": ("torch",) * 6}}, "must name qkv, out, gate_up, down, head"),
    ({"linear": dict.fromkeys(LINEAR_KINDS, ("torch",) * 5)}, "must be 6 of"),
    ({"linear": dict.fromkeys(LINEAR_KINDS, ("torch",) * 5 + ("avx",))}, "must be 6 of"),
    ({"linear": dict.fromkeys(LINEAR_KINDS, ("torch",) * 5 + ("blocked",))}, "for 1-16 rows only"),
    ({"stack": (True,) * 6}, "must have 5 entries"),
    ({"prefill_attention": "sdpa"}, "prefill_attention must be one of"),
    ({"decode_attention": "fast"}, "decode_attention must be one of"),
    ({"deterministic": True}, "a deterministic plan takes the blocked kernel at every row count"),
    ({"deterministic": True, "linear": dict.fromkeys(LINEAR_KINDS, ("blocked",) * 6),
      "stack": (True, False, True, True, True)}, "takes the stack at every few-row bucket or at none"),
    ({"deterministic": True, "linear": dict.fromkeys(LINEAR_KINDS, ("blocked",) * 6), "stack": (False,) * 5,
      "prefill_attention": "torch"}, "a deterministic plan takes the C\\+\\+ attention"),
])
def test_a_plan_that_does_not_fit_is_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _plan(**changes)


def test_stack_rows_follow_the_buckets() -> None:
    assert _plan(stack=(True, True, False, True, False)).stack_rows == (1, 2, 5, 6, 7, 8)
    assert _plan(stack=(False,) * FEW_ROW_BUCKETS).stack_rows == ()


def test_a_plan_reads_back_as_written() -> None:
    plan = _plan(linear={**builtin_plan(packed=True).linear, "head": ("onednn",) * 6},
                 stack=(True, False, False, False, False), decode_attention="torch", source="measured",
                 cpu="Some CPU [avx2]", timings_us={"stack.1.stack": 12.5})
    back = KernelPlan.from_json(plan.to_json())
    assert back == dataclasses.replace(plan, source="cached")
    with pytest.raises(ValueError, match="not a version-1 kernel plan"):
        KernelPlan.from_json(plan.to_json().replace('"version": 1', '"version": 0'))
    with pytest.raises(ValueError, match="not a kernel plan"):
        KernelPlan.from_json('{"version": 1}')
    with pytest.raises(ValueError, match="not a kernel plan"):
        KernelPlan.from_json("{")


def test_linear_kernel_takes_each_bucket_s_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LinearKernel.use`: the path of each row bucket, counted at the kernels it calls; `drop_unused` frees the
    copies no bucket reads, and a path without its copy becomes F.linear."""
    if cpu_small.load() is None:
        pytest.skip("the C++ CPU kernels did not build here")  # the blocked path needs them
    weight = torch.randn(48, 32).to(torch.bfloat16)
    kernel = LinearKernel(weight, None)
    calls: list[tuple[str, int]] = []
    real_blocked = cpu_small.blocked_linear
    monkeypatch.setattr(cpu_small, "blocked_linear", lambda *a: calls.append(("blocked", a[1].shape[0]))
                        or real_blocked(*a))
    real_linear = F.linear
    monkeypatch.setattr(linear_kernel.F, "linear", lambda x, *a: calls.append(("torch", x.shape[0]))
                        or real_linear(x, *a))
    many = "onednn" if packing_supported(torch.bfloat16) else "torch"
    kernel.use(("torch", "blocked", "torch", "blocked", "torch", many))
    for rows in (1, 2, 4, 8, 16):
        kernel(torch.randn(rows, 32).to(torch.bfloat16))
    assert calls == [("torch", 1), ("blocked", 2), ("torch", 4), ("blocked", 8), ("torch", 16)]
    kernel.drop_unused(keep_blocked=False)
    assert kernel.blocked is not None and (kernel.packed is not None) == (many == "onednn")
    kernel.use(("torch",) * 6)
    kernel.drop_unused(keep_blocked=True)
    assert kernel.blocked is not None and kernel.packed is None
    kernel.drop_unused(keep_blocked=False)
    assert kernel.blocked is None
    kernel.use(("blocked",) * 5 + ("onednn",))  # the copies are gone: F.linear
    assert kernel.paths == ("torch",) * 6
    calls.clear()
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert torch.equal(kernel(x), real_linear(x, weight)) and calls == [("torch", 3)]


def _generate(model_dir, plan: KernelPlan | None) -> tuple[dict[str, tuple[list[int], list]], LlamaForCausalLM]:
    """float32 greedy tokens and logprobs of ten ragged requests under ``plan`` (None: the builtin rule)."""
    loaded = load_model(model_dir, dtype="float32")
    if plan is not None:
        apply_kernel_plan(loaded.model, plan)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=96, enable_prefix_caching=False, kernel_plan="builtin"))
    assert engine.kernel_plan is plan if plan is not None else engine.kernel_plan.source == "builtin"
    for i in range(10):
        prompt = [(5 * i + 3 * j) % 200 + 1 for j in range(3 + 9 * i)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3 + i, logprobs=2, ignore_eos=True))
    out: dict[str, tuple[list[int], list]] = {f"r{i}": ([], []) for i in range(10)}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id][0].extend(step.new_token_ids)
            out[step.request_id][1].extend(step.logprobs or [])
    return out, loaded.model


def test_a_plan_without_the_stack_frees_it_and_gives_the_same_bits(tiny_model_dir) -> None:
    """The same linear paths without the one-call stack: the per-layer path, the same bits (the stack runs the
    same kernels in the same order); the stack and its hold on the blocked copies are gone."""
    if cpu_small.load() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    want, _ = _generate(tiny_model_dir, None)
    no_stack = dataclasses.replace(builtin_plan(packed=False), stack=(False,) * FEW_ROW_BUCKETS)
    got, model = _generate(tiny_model_dir, no_stack)
    assert got == want
    assert model.decode_stack is None and not model.stack_logits
    assert all(layer.fused is None for layer in model.model.layers)
    assert all(k.blocked is not None for kernels in linear_kernels(model).values() for k in kernels)


def test_a_plan_on_torch_paths_frees_every_copy(tiny_model_dir) -> None:
    """Every linear on F.linear, torch attention, no stack: no blocked or packed copy is left, and the greedy
    tokens are those of the builtin rule (float32: the paths differ in summation order only)."""
    want, _ = _generate(tiny_model_dir, None)
    torch_only = KernelPlan(linear=dict.fromkeys(LINEAR_KINDS, ("torch",) * 6), stack=(False,) * FEW_ROW_BUCKETS,
                            prefill_attention="torch", decode_attention="torch")
    got, model = _generate(tiny_model_dir, torch_only)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    kernels = [k for ks in linear_kernels(model).values() for k in ks]
    assert len(kernels) == 4 * len(model.model.layers) + 1
    assert all(k.blocked is None and k.packed is None and k.paths == ("torch",) * 6 for k in kernels)
