"""Applying a `model.kernel_plan.KernelPlan` to a `model.llama.LlamaForCausalLM`: its dense linear kernels by kind,
each kernel's path per row bucket, the one-call decode step where the plan keeps it, and the weight copies no chosen
path reads freed. Kept out of the model: the plan is how a CPU runs the model, not the model."""

from __future__ import annotations

from kvrelay.model.kernel_plan import KernelPlan
from kvrelay.model.linear_kernel import LinearKernel, colocate_blocked
from kvrelay.model.llama import MLP, Attention, LlamaForCausalLM


def linear_kernels(model: LlamaForCausalLM) -> dict[str, list[LinearKernel]]:
    """``model``'s dense linear kernels by `model.kernel_plan.LINEAR_KINDS` kind, layer order (after
    `LlamaForCausalLM.prepare_for_inference`; MoE experts and MLA projections are not among them: they keep the
    built-in rule)."""
    kinds: dict[str, list[LinearKernel]] = {"qkv": [], "out": [], "gate_up": [], "down": [],
                                            "head": [model.head] if model.head is not None else []}
    for layer in model.model.layers:
        attn, ffn = layer.self_attn, layer.ffn
        for kind, owner, name in (("qkv", attn, "qkv"), ("out", attn, "out"), ("gate_up", ffn, "gate_up"),
                                  ("down", ffn, "down")):
            kernel = getattr(owner, name, None) if isinstance(owner, (Attention, MLP)) else None
            if kernel is not None:
                kinds[kind].append(kernel)
    return kinds


def apply_kernel_plan(model: LlamaForCausalLM, plan: KernelPlan) -> None:
    """Take ``plan``'s paths: each dense linear kernel's per row bucket, the one-call decode path's row counts, and
    free the weight copies no chosen path reads (without the stack, its blocked copies and the stack itself; the
    blocked copies left are gathered into a new huge-page buffer). A deterministic plan's stack splits each
    sequence's keys into one part. A copy freed is gone: apply a plan once, after
    `LlamaForCausalLM.prepare_for_inference` (a second call may only drop more).

    Raises:
        ValueError: a deterministic plan with the stack for a model without one (its layers would run the one-call
            layer, whose attention splits the keys by the thread count).
    """
    stack = any(plan.stack)
    if plan.deterministic and stack:
        if model.decode_stack is None:
            raise ValueError("a deterministic plan takes the stack only for a model whose every layer fuses")
        model.decode_stack.set_fixed_parts(1)
    for kind, kernels in linear_kernels(model).items():
        for kernel in kernels:
            kernel.use(plan.linear[kind])
            kernel.drop_unused(keep_blocked=stack)
    model.stack_by_bucket = plan.stack
    if not stack:
        model.decode_stack, model.stack_norms, model.stack_logits = None, False, False
        for layer in model.model.layers:
            layer.fused = None  # it holds the blocked copies
        colocate_blocked([k for kernels in linear_kernels(model).values() for k in kernels])
    model.kernel_plan = plan
