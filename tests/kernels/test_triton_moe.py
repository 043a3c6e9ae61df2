"""The Triton fused-MoE kernels against `kernels.moe_reference.fused_experts_reference`, and the exact layout
of `moe_align_block_size`.

On CPU it runs under ``TRITON_INTERPRET=1`` (set by this folder's conftest); with CUDA it runs compiled.
Routings are top-k of random logits (distinct experts per token), so small ``T`` with ``E = 8`` leaves
experts with no rows; hidden and intermediate sizes are not multiples of the tiles, so every GEMM masks
columns and the K loop's tail.
"""

from __future__ import annotations

import pytest
import torch
from kvrelay.kernels import moe_reference as mr
from kvrelay.kernels import triton_moe as tm

HIDDEN = 32
INTER = 48
FP32_TOLERANCE = 1e-5
# bf16/fp16, relative to the largest output: the reference rounds to the input dtype after every op (and
# sums the k experts in it), the kernel only when storing the activation and the output.
HALF_REL_TOLERANCE = 2e-2


def make_inputs(num_tokens: int, num_experts: int, top_k: int, device: torch.device, *, dtype: torch.dtype,
                bias: bool, hidden: int = HIDDEN, inter: int = INTER, scale: float = 1.0,
                seed: int = 0) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor | None]]:
    """``(x, w_gate_up, w_down, topk_weights, topk_ids)`` and the bias keywords; ``scale`` multiplies ``x``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=dtype)

    x = randn(num_tokens, hidden, std=scale)
    w_gate_up = randn(num_experts, 2 * inter, hidden, std=hidden ** -0.5)
    w_down = randn(num_experts, hidden, inter, std=inter ** -0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    topk_ids = logits.topk(top_k, dim=1).indices.to(device=device, dtype=torch.int32)
    # Not renormalised, so that k = 1 has a weight other than 1 too.
    topk_weights = (torch.rand(num_tokens, top_k, generator=gen) + 0.25).to(device)
    biases = dict(b_gate_up=randn(num_experts, 2 * inter, std=0.5) if bias else None,
                  b_down=randn(num_experts, hidden, std=0.5) if bias else None)
    return (x, w_gate_up, w_down, topk_weights, topk_ids), biases


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def expected_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list, list, int]:
    """The layout spelled out pair by pair: each expert's pairs in order, padded with P to a block edge."""
    flat = topk_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        num_blocks = -(-len(pairs) // block_m)
        sorted_ids += pairs + [num_pairs] * (num_blocks * block_m - len(pairs))
        expert_ids += [expert] * num_blocks
    used = len(sorted_ids)
    capacity = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    sorted_ids += [num_pairs] * (capacity - used)
    expert_ids += [num_experts] * (capacity // block_m - len(expert_ids))
    return sorted_ids, expert_ids, used


# --- moe_align_block_size ---------------------------------------------------------------------------


def test_align_golden():
    """The module docstring's picture: expert 1 has no rows, every group padded to 4 with P = 8."""
    topk_ids = torch.tensor([[0, 2], [2, 3], [0, 2], [2, 0]])  # pairs 0..7
    got = tm.moe_align_block_size(topk_ids, 4, 4)
    assert got.sorted_token_ids.tolist() == [0, 4, 7, 8, 1, 2, 5, 6, 3, 8, 8, 8] + [8] * 8
    assert got.expert_ids.tolist() == [0, 2, 3, 4, 4]
    assert got.num_tokens_post_padded.tolist() == [12]
    assert got.sorted_token_ids.dtype == got.expert_ids.dtype == got.num_tokens_post_padded.dtype == torch.int32


@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"),
                         [(1, 8, 1), (7, 8, 2), (33, 4, 4), (50, 16, 3), (5, 1, 1), (0, 4, 2)])
def test_align_matches_pair_by_pair_layout(num_tokens, num_experts, top_k, block_m, kernel_device):
    gen = torch.Generator().manual_seed(num_tokens * 131 + block_m)
    topk_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)  # repeats allowed
    # Crowd half the tokens onto expert 0 so that some expert spans several blocks and others get nothing.
    topk_ids[: num_tokens // 2] = 0
    want_sorted, want_experts, want_used = expected_alignment(topk_ids, num_experts, block_m)
    got = tm.moe_align_block_size(topk_ids.to(kernel_device, torch.int32), num_experts, block_m)
    assert got.sorted_token_ids.tolist() == want_sorted
    assert got.expert_ids.tolist() == want_experts
    assert got.num_tokens_post_padded.tolist() == [want_used]
    real = got.sorted_token_ids[got.sorted_token_ids < num_tokens * top_k]
    assert sorted(real.tolist()) == list(range(num_tokens * top_k))  # every pair exactly once


def test_align_rejects():
    with pytest.raises(ValueError, match=r"topk_ids must be 2-D int32/int64"):
        tm.moe_align_block_size(torch.zeros(3, 2), 4, 16)
    with pytest.raises(ValueError, match=r"num_experts must be >= 1"):
        tm.moe_align_block_size(torch.zeros(3, 2, dtype=torch.int32), 0, 16)
    with pytest.raises(ValueError, match=r"block_m must be >= 1"):
        tm.moe_align_block_size(torch.zeros(3, 2, dtype=torch.int32), 4, 0)


def test_tile_config():
    assert [tm.tile_config(p, 8).block_m for p in (0, 1, 8, 128, 136, 256, 257, 10_000)] == [
        16, 16, 16, 16, 32, 32, 64, 64]
    assert tm.tile_config(1, 1) == tm.MoeTiles(block_m=16, block_n=64, block_k=32)


def test_activation_names_agree():
    assert set(tm.ACTIVATION_CODES) == set(mr.ACTIVATIONS)


# --- fused_experts against the reference ------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(dtype, activation, bias, top_k, num_experts, num_tokens, kernel_device):
    args, biases = make_inputs(num_tokens, num_experts, top_k, kernel_device, dtype=dtype, bias=bias,
                               seed=num_tokens + 10 * num_experts + 100 * top_k)
    got = tm.fused_experts(*args, **biases, activation=activation)
    want = mr.fused_experts_reference(*args, **biases, activation=activation)
    if dtype == torch.float32:
        assert max_err(got, want) <= FP32_TOLERANCE
    else:
        assert max_err(got, want) <= HALF_REL_TOLERANCE * max(1.0, want.abs().max().item())


def test_swiglu_limit_binds(kernel_device):
    """Pre-activations far past the limit: many are clamped, the clamp changes the output, the kernel
    clamps as the reference does."""
    args, biases = make_inputs(33, 8, 2, kernel_device, dtype=torch.float32, bias=True, scale=12.0)
    x, w_gate_up, _, _, topk_ids = args
    pre = torch.einsum("th,tkih->tki", x, w_gate_up[topk_ids.long()])  # [T, k, 2I] before the bias
    assert (pre[..., :INTER] > 7.0).float().mean() > 0.2
    assert (pre[..., INTER:].abs() > 7.0).float().mean() > 0.3
    got = tm.fused_experts(*args, **biases, activation="swiglu_oai", swiglu_limit=7.0)
    want = mr.fused_experts_reference(*args, **biases, activation="swiglu_oai", swiglu_limit=7.0)
    unclamped = mr.fused_experts_reference(*args, **biases, activation="swiglu_oai", swiglu_limit=1e30)
    scale = want.abs().max().item()
    assert max_err(got, want) <= FP32_TOLERANCE * scale
    assert max_err(unclamped, want) > 0.5 * scale


def test_several_column_tiles_and_k_steps(kernel_device):
    """H = 80 and I = 72: two column tiles in each GEMM, three K steps with a masked tail."""
    args, biases = make_inputs(33, 8, 2, kernel_device, dtype=torch.float32, bias=True, hidden=80, inter=72)
    got = tm.fused_experts(*args, **biases, activation="swiglu_oai", swiglu_alpha=1.5, swiglu_limit=2.0)
    want = mr.fused_experts_reference(*args, **biases, activation="swiglu_oai", swiglu_alpha=1.5,
                                      swiglu_limit=2.0)
    assert max_err(got, want) <= FP32_TOLERANCE


def test_strided_x_int64_ids_repeated_expert_and_fp16(kernel_device):
    """x sliced from a wider tensor, int64 ids, a token routed twice to one expert (both count), fp16."""
    args, biases = make_inputs(9, 4, 2, kernel_device, dtype=torch.float16, bias=True)
    x, w_gate_up, w_down, topk_weights, topk_ids = args
    wide = torch.randn(9, HIDDEN + 16, device=kernel_device, dtype=torch.float16)
    wide[:, :HIDDEN] = x
    topk_ids = topk_ids.long()
    topk_ids[3] = 1
    args = (wide[:, :HIDDEN], w_gate_up, w_down, topk_weights, topk_ids)
    got = tm.fused_experts(*args, **biases)
    want = mr.fused_experts_reference(*args, **biases)
    assert max_err(got, want) <= HALF_REL_TOLERANCE * max(1.0, want.abs().max().item())


def test_no_tokens(kernel_device):
    args, biases = make_inputs(0, 4, 2, kernel_device, dtype=torch.float32, bias=True)
    got = tm.fused_experts(*args, **biases)
    assert got.shape == (0, HIDDEN) and got.dtype == torch.float32
    assert mr.fused_experts_reference(*args, **biases).shape == (0, HIDDEN)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(x=a["x"].long()), r"x\.dtype is torch\.int64"),
        (lambda a: a.update(x=a["x"][None]), r"x must be 2-D"),
        (lambda a: a.update(x=a["x"].t().contiguous().t()), r"x must be contiguous in its last dim"),
        (lambda a: a.update(w_gate_up=a["w_gate_up"].half()), r"w_gate_up\.dtype is torch\.float16"),
        (lambda a: a.update(w_gate_up=a["w_gate_up"][:, :-1]), r"w_gate_up shape \(4, 95, 32\) is not \[E, 2I, H\]"),
        (lambda a: a.update(w_gate_up=a["w_gate_up"][..., :16]), r"w_gate_up shape \(4, 96, 16\) is not"),
        (lambda a: a.update(w_down=a["w_down"][:, :, :8]), r"w_down shape \(4, 32, 8\) != \[E, H, I\]"),
        (lambda a: a.update(w_down=a["w_down"].bfloat16()), r"w_down\.dtype is torch\.bfloat16"),
        (lambda a: a.update(topk_weights=a["topk_weights"].bfloat16()), r"topk_weights\.dtype is torch\.bfloat16"),
        (lambda a: a.update(topk_weights=a["topk_weights"][:2]), r"topk_weights shape \(2, 2\) is not \[T, k\]"),
        (lambda a: a.update(topk_ids=a["topk_ids"].float()), r"topk_ids\.dtype is torch\.float32"),
        (lambda a: a.update(topk_ids=a["topk_ids"][:, :1]), r"topk_ids shape \(3, 1\) != topk_weights shape"),
        (lambda a: a.update(b_gate_up=a["b_down"]), r"b_gate_up shape \(4, 32\) != \(4, 96\)"),
        (lambda a: a.update(b_down=a["b_down"].double()), r"b_down\.dtype is torch\.float64"),
        (lambda a: a.update(activation="gelu"), r"activation 'gelu' is unknown; use one of \['silu', 'swiglu_oai'\]"),
    ],
)
def test_launcher_rejects(change, message, kernel_device):
    (x, w_gate_up, w_down, topk_weights, topk_ids), biases = make_inputs(3, 4, 2, kernel_device,
                                                                         dtype=torch.float32, bias=True)
    args = dict(x=x, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights, topk_ids=topk_ids, **biases)
    change(args)
    with pytest.raises(ValueError, match=message):
        tm.fused_experts(**args)


def test_reference_rejects_unknown_activation():
    args, _ = make_inputs(3, 4, 2, torch.device("cpu"), dtype=torch.float32, bias=False)
    with pytest.raises(ValueError, match=r"activation 'relu' is unknown"):
        mr.fused_experts_reference(*args, activation="relu")


# --- compiled on CUDA -------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (T, E, k, H, I): a decode step over many experts, a mid-size batch, a prefill chunk (BLOCK_M 64).
GPU_SHAPES = [(1, 128, 4, 1024, 768), (257, 32, 4, 2048, 512), (2048, 8, 2, 1024, 1536)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "hidden", "inter"), GPU_SHAPES)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_matches_reference(dtype, activation, num_tokens, num_experts, top_k, hidden, inter, no_tf32):
    args, biases = make_inputs(num_tokens, num_experts, top_k, torch.device("cuda"), dtype=dtype, bias=True,
                               hidden=hidden, inter=inter)
    got = tm.fused_experts(*args, **biases, activation=activation)
    want = mr.fused_experts_reference(*args, **biases, activation=activation)
    scale = max(1.0, want.abs().max().item())
    assert max_err(got, want) <= (1e-4 if dtype == torch.float32 else HALF_REL_TOLERANCE) * scale
