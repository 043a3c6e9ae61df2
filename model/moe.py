"""Mixture-of-experts MLPs: Qwen3-MoE, Mixtral and gpt-oss, with Hugging Face's parameter names.

One MoE layer routes each token to ``top_k`` of ``num_experts`` SwiGLU experts and sums their outputs
weighted by the router (`route`). Parameters keep each checkpoint's own names and layouts, so loading
stays a straight name match (`model.loader`)::

    qwen3_moe  mlp.gate.weight [E, H]                 mlp.experts.{e}.gate_proj / up_proj / down_proj
    mixtral    block_sparse_moe.gate.weight [E, H]    block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down)
    gpt_oss    mlp.router.weight [E, H], .bias [E]    mlp.experts.gate_up_proj [E, H, 2I] (gate and up
               interleaved: gate = [..., 0::2]), gate_up_proj_bias [E, 2I], down_proj [E, I, H],
               down_proj_bias [E, H]

`SparseMoe.prepare` restacks every layout into one ``w_gate_up [E, 2I, H]`` (gate rows first, then up)
and ``w_down [E, H, I]`` (``nn.Linear`` layout, ``y = x Wᵀ``) and re-points the checkpoint-named
parameters at views of them, so the weights are held once. Two ways to run the experts:

* CPU (`experts_grouped`): the step's (token, expert) pairs sorted by expert; each expert's rows are one
  matmul through `LinearKernel` (oneDNN's packed bf16 path, as the dense MLP), one loop over the experts
  that received tokens, none over tokens.
* CUDA: `kernels.triton_moe.fused_experts`, a grouped GEMM over expert-sorted token blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvrelay.kernels.moe_reference import ACTIVATIONS
from kvrelay.model.config import ModelConfig, MoeConfig
from kvrelay.model.linear_kernel import LinearKernel
from torch import nn


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights, exactly as transformers routes.

    Args:
        logits: ``[T, E]`` router logits in the model's dtype.

    Returns:
        ``(weights [T, k] float32, ids [T, k] int64)``. ``softmax_topk``: softmax over all logits in
        float32, the k largest (ties: `torch.topk`'s order), divided by their sum when
        ``norm_topk_prob``. ``topk_softmax``: the k largest logits, softmax over them (in the logits'
        dtype, as gpt-oss), then float32.
    """
    if moe.routing == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    top, ids = torch.topk(logits, moe.top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype).float(), ids


def activate(gate_up: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """``[n, 2I]`` (gate columns then up columns) → ``[n, I]`` (see `MoeConfig.activation`; the functions of
    `kernels.moe_reference`, which the Triton kernel is tested against)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[moe.activation](gate, up, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)


class _Expert(nn.Module):
    """One expert of Mixtral or Qwen3-MoE: three ``nn.Linear`` under the checkpoint's names."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names  # (gate, up, down)
        for name, (out_f, in_f) in zip(names, ((inter, hidden), (inter, hidden), (hidden, inter)), strict=True):
            setattr(self, name, nn.Linear(in_f, out_f, bias=False))


class GptOssExperts(nn.Module):
    """gpt-oss's fused expert tensors (names and layouts as its checkpoints store them)."""

    def __init__(self, hidden: int, inter: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))


class _Router(nn.Module):
    """gpt-oss's ``router`` (weight and bias); Mixtral and Qwen3-MoE use a bias-free ``nn.Linear`` ``gate``."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))


class SparseMoe(nn.Module):
    """One mixture-of-experts MLP ``[T, H] → [T, H]`` (see module doc)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        hidden, inter, e = config.hidden_size, moe.intermediate_size, moe.num_experts
        self.family = config.model_type
        if self.family == "gpt_oss":
            self.router = _Router(hidden, e)
            self.experts: nn.Module = GptOssExperts(hidden, inter, e)
        else:
            self.gate = nn.Linear(hidden, e, bias=False)
            names = ("w1", "w3", "w2") if self.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            self.experts = nn.ModuleList(_Expert(hidden, inter, names) for _ in range(e))
        self.w_gate_up: torch.Tensor | None = None  # set by `prepare`
        self.b_gate_up: torch.Tensor | None = None
        self.w_down: torch.Tensor | None = None
        self.b_down: torch.Tensor | None = None
        self.kernels: list[tuple[LinearKernel, LinearKernel]] = []
        self.use_triton = False

    def router_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.family == "gpt_oss":
            return self.router.weight, self.router.bias
        return self.gate.weight, None

    def prepare(self, *, use_triton: bool = False) -> None:
        """Restack the experts (see module doc) and build each expert's matmul kernels. ``use_triton``:
        run the experts through `kernels.triton_moe.fused_experts` (CUDA, or the interpreter in tests)."""
        if self.family == "gpt_oss":
            ex = self.experts
            num, hidden, two_inter = ex.gate_up_proj.shape
            inter = two_inter // 2
            w = ex.gate_up_proj.detach().view(num, hidden, inter, 2).permute(0, 3, 2, 1).reshape(num, two_inter, hidden)
            b = ex.gate_up_proj_bias.detach().view(num, inter, 2).permute(0, 2, 1).reshape(num, two_inter)
            self.w_gate_up, self.b_gate_up = w.contiguous(), b.contiguous()
            self.w_down = ex.down_proj.detach().transpose(1, 2).contiguous()
            self.b_down = ex.down_proj_bias.detach().contiguous()
            # the checkpoint-named parameters become views of the restacked tensors (the weights are held
            # once): gate_up_proj [E, H, 2I] interleaved is seen as [E, H, I, 2], its bias as [E, I, 2]
            ex.gate_up_proj = _frozen(self.w_gate_up.view(num, 2, inter, hidden).permute(0, 3, 2, 1))
            ex.gate_up_proj_bias = _frozen(self.b_gate_up.view(num, 2, inter).permute(0, 2, 1))
            ex.down_proj = _frozen(self.w_down.transpose(1, 2))
            ex.down_proj_bias = _frozen(self.b_down)
        else:
            gate_n, up_n, down_n = self.experts[0].names
            self.w_gate_up = torch.stack([
                torch.cat([getattr(x, gate_n).weight.detach(), getattr(x, up_n).weight.detach()])
                for x in self.experts])
            self.w_down = torch.stack([getattr(x, down_n).weight.detach() for x in self.experts])
            inter = self.w_down.shape[2]
            for i, x in enumerate(self.experts):
                getattr(x, gate_n).weight = _frozen(self.w_gate_up[i, :inter])
                getattr(x, up_n).weight = _frozen(self.w_gate_up[i, inter:])
                getattr(x, down_n).weight = _frozen(self.w_down[i])
        self.use_triton = use_triton
        if not use_triton:
            self.kernels = [
                (LinearKernel(self.w_gate_up[i], None if self.b_gate_up is None else self.b_gate_up[i]),
                 LinearKernel(self.w_down[i], None if self.b_down is None else self.b_down[i]))
                for i in range(self.w_gate_up.shape[0])
            ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.router_weights()
        weights, ids = route(F.linear(x, weight, bias), self.moe)
        if self.w_gate_up is None:
            self.prepare()
        if self.use_triton:
            from kvrelay.kernels.triton_moe import fused_experts  # lazily: Triton needs a GPU or TRITON_INTERPRET

            return fused_experts(x, self.w_gate_up, self.w_down, weights, ids, b_gate_up=self.b_gate_up,
                                 b_down=self.b_down, activation=self.moe.activation,
                                 swiglu_alpha=self.moe.swiglu_alpha, swiglu_limit=self.moe.swiglu_limit)
        return experts_grouped(x, weights, ids, self.kernels, self.moe)


def experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    kernels: list[tuple[LinearKernel, LinearKernel]], moe: MoeConfig) -> torch.Tensor:
    """The experts' weighted sum ``[T, H]`` for ``x`` ``[T, H]`` routed as ``(weights, ids)`` ``[T, k]``.

    The T·k (token, expert) pairs are sorted by expert (stable, so each expert's tokens stay in order);
    each expert that received any is one ``gate_up`` matmul and one ``down`` matmul over its rows, the
    activation one pass over all rows between them. Each row is weighted in float32, cast to ``x.dtype``
    and added to its token's output in expert order, as transformers' eager experts add them.
    """
    t, k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    if t == 1:  # one token (batch-1 decode): its k experts in expert order, without the sort
        pairs = sorted(zip(ids[0].tolist(), range(k), strict=True))
        acc = None
        for e, j in pairs:
            gate_up, down = kernels[e]
            y = (down(activate(gate_up(x), moe)).float() * weights[:, j : j + 1]).to(x.dtype)
            acc = y if acc is None else acc + y
        return acc
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(kernels)).tolist()
    used = [(e, n) for e, n in enumerate(counts) if n]
    sizes = [n for _, n in used]
    rows = order // k
    segments = x.index_select(0, rows).split(sizes)
    hidden = torch.cat([kernels[e][0](seg) for (e, _), seg in zip(used, segments, strict=True)])
    acts = activate(hidden, moe).split(sizes)
    out = torch.cat([kernels[e][1](seg) for (e, _), seg in zip(used, acts, strict=True)])
    out = (out.float() * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, rows, out)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)
