"""Plain-torch mixture-of-experts experts block: the oracle for `kernels.triton_moe.fused_experts` and the
CPU path.

Each of the ``T`` tokens is routed to ``k`` experts (``topk_ids[t]``) with weights ``topk_weights[t]``::

    gate_up = x[t] @ w_gate_up[e].T + b_gate_up[e]          [2I]   rows [0, I) gate, rows [I, 2I) up
    a       = act(gate_up[:I], gate_up[I:])                 [I]
    out[t] += topk_weights[t, j] * (a @ w_down[e].T + b_down[e])     for j < k, e = topk_ids[t, j]

The math follows transformers' eager experts (Mixtral, gpt-oss) step by step: matmuls, biases and the
activation in ``x.dtype``; the routing weight (float32) multiplies by type promotion, so in float32; each
expert's weighted rows are cast back to ``x.dtype`` and summed into the output in ``x.dtype`` by
``index_add_``, experts in ascending order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """``silu(gate) * up`` (Mixtral, Qwen-MoE, DeepSeek); ``alpha`` and ``limit`` are unused."""
    del alpha, limit
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


# Activation name (the ``activation`` argument) -> function of (gate, up).
ACTIVATIONS: dict[str, Callable[..., torch.Tensor]] = {"silu": silu_and_mul, "swiglu_oai": swiglu_oai}


def fused_experts_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """The experts block of one MoE layer, one expert at a time.

    Args:
        x: ``[T, H]`` float32/bfloat16/float16.
        w_gate_up: ``[E, 2I, H]`` in ``x.dtype`` (nn.Linear layout, ``y = x @ W.T``); rows ``[0, I)`` are the
            gate projection, rows ``[I, 2I)`` the up projection.
        w_down: ``[E, H, I]`` in ``x.dtype``.
        topk_weights: ``[T, k]`` float32 routing weights (not renormalised here).
        topk_ids: ``[T, k]`` int32/int64 expert ids in ``[0, E)``; a row may repeat an id (each counts).
        b_gate_up: optional ``[E, 2I]`` bias of the gate/up projection, in ``x.dtype``.
        b_down: optional ``[E, H]`` bias of the down projection, in ``x.dtype``.
        activation: a key of `ACTIVATIONS`: ``"silu"`` or ``"swiglu_oai"`` (gpt-oss).
        swiglu_alpha, swiglu_limit: the ``"swiglu_oai"`` constants; ignored by ``"silu"``.

    Returns:
        ``[T, H]`` in ``x.dtype``, newly allocated. Nothing is mutated.

    Raises:
        ValueError: ``activation`` is not a key of `ACTIVATIONS`. Shapes are not checked here (the Triton
            launcher checks them); a mismatch fails inside torch.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is unknown; use one of {sorted(ACTIVATIONS)}")
    act = ACTIVATIONS[activation]
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    # [E, k, T] as transformers builds it: within an expert, rows come ordered by (k position, token).
    ids_by_position = topk_ids.t()
    for expert in torch.unique(topk_ids).tolist():
        k_pos, token_idx = torch.where(ids_by_position == expert)
        gate_up = x[token_idx] @ w_gate_up[expert].t()
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[expert]
        a = act(gate_up[:, :inter], gate_up[:, inter:], alpha=swiglu_alpha, limit=swiglu_limit)
        y = a @ w_down[expert].t()
        if b_down is not None:
            y = y + b_down[expert]
        weighted = y * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, weighted.to(x.dtype))
    return out
