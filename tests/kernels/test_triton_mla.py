"""Multi-head latent attention (DeepSeek) kernels: the Triton decode kernel against `kernels.reference.paged_mla_decode`
(under ``TRITON_INTERPRET=1`` on CPU, compiled with CUDA), the absorbed reference against the generic paged
decode kernel, and the absorbed path against transformers' unabsorbed math (`reference.mla_unabsorbed_attention`).

Latent rows live in one layer's plane of a real MLA pool (`BlockSpec.num_planes` = 1) behind ragged lengths and
shuffled block tables padded with out-of-range ids that must never be read."""

from __future__ import annotations

import pytest
import torch
from kvrelay.kernels import reference
from kvrelay.kvstore.block_spec import BlockSpec

from tests.kernels.test_triton_attention import PAD_BLOCK_ID, make_block_tables, max_err, requires_cuda

RANK, ROPE = 32, 8
LAYER = 1


def latent_plane(num_blocks: int, block_size: int, device: torch.device, seed: int, dtype: str = "float32",
                 width: int = RANK + ROPE):
    """A random 3-layer MLA pool; returns (pool, layer `LAYER`'s ``[num_blocks, B, width]`` rows view)."""
    spec = BlockSpec(num_layers=3, num_kv_heads=1, head_dim=width, block_size_tokens=block_size, dtype=dtype,
                     num_planes=1)
    assert spec.block_bytes == 3 * width * block_size * spec.itemsize  # one latent row per token and layer
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(spec.pool_shape(num_blocks), generator=gen).to(spec.torch_dtype).to(device)
    rows = pool[:, LAYER, 0, 0]
    assert not rows.is_contiguous()
    return pool, rows


CASES = [  # (sequence lengths, heads, block size, table width)
    ((1, 17, 64, 5), 4, 16, 6),
    ((300, 33, 2), 20, 16, 20),  # 20 heads: two head blocks, the second part-filled; 300 tokens over splits
    ((7, 129, 64, 90, 1), 16, 32, 5),
]


@pytest.mark.parametrize("lens,heads,block_size,width", CASES, ids=str)
def test_triton_mla_decode_equals_the_reference(lens, heads, block_size, width, kernel_device):
    from kvrelay.kernels import triton_mla

    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    _, rows = latent_plane(num_blocks, block_size, kernel_device, seed=len(lens))
    tables = make_block_tables(lens, block_size, width, num_blocks, seed=heads).to(kernel_device)
    assert (tables == PAD_BLOCK_ID).any()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=kernel_device)
    q = torch.randn(len(lens), heads, RANK + ROPE, generator=torch.Generator().manual_seed(9)).to(kernel_device)
    got = triton_mla.paged_mla_decode(q, rows, tables, seq_lens, kv_lora_rank=RANK, scale=0.2)
    want = reference.paged_mla_decode(q, rows, tables, seq_lens, kv_lora_rank=RANK, scale=0.2)
    assert got.shape == (len(lens), heads, RANK)
    assert max_err(got, want) <= 1e-5


def test_triton_mla_decode_bf16(kernel_device):
    from kvrelay.kernels import triton_mla

    lens, block_size = (40, 3, 100), 16
    _, rows = latent_plane(12, block_size, kernel_device, seed=3, dtype="bfloat16")
    tables = make_block_tables(lens, block_size, 8, 12, seed=4).to(kernel_device)
    seq_lens = torch.tensor(lens, device=kernel_device)
    q = torch.randn(3, 8, RANK + ROPE, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(kernel_device)
    got = triton_mla.paged_mla_decode(q, rows, tables, seq_lens, kv_lora_rank=RANK, scale=0.2)
    want = reference.paged_mla_decode(q, rows, tables, seq_lens, kv_lora_rank=RANK, scale=0.2)
    assert got.dtype == torch.bfloat16 and max_err(got, want) <= 2e-2


def test_triton_mla_decode_names_bad_input(kernel_device):
    from kvrelay.kernels import triton_mla

    _, rows = latent_plane(4, 16, kernel_device, seed=1)
    q = torch.zeros(1, 4, RANK + ROPE, device=kernel_device)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=kernel_device)
    lens = torch.ones(1, dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match="kv_lora_rank 40 must be in 1..39"):
        triton_mla.paged_mla_decode(q, rows, tables, lens, kv_lora_rank=RANK + ROPE, scale=1.0)
    with pytest.raises(ValueError, match="q's width 36 != latent_cache's 40"):
        triton_mla.paged_mla_decode(q[..., :36], rows, tables, lens, kv_lora_rank=RANK, scale=1.0)


def test_absorbed_reference_is_the_generic_decode_kernel_with_the_rows_as_keys_and_values():
    """What `model.deepseek.MlaAttention`'s absorbed decode relies on off Triton: one KV head whose keys and values
    are the latent rows, output cut to the latent's width."""
    lens, block_size = (5, 37, 70), 16
    num_blocks = 12
    _, rows = latent_plane(num_blocks, block_size, torch.device("cpu"), seed=7)
    tables = make_block_tables(lens, block_size, 6, num_blocks, seed=8)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 6, RANK + ROPE, generator=torch.Generator().manual_seed(1))
    plane = rows[:, None]  # [num_blocks, 1 KV head, B, W]
    generic = reference.paged_decode_attention(q, plane, plane, tables, seq_lens, scale=0.3)[..., :RANK]
    assert max_err(reference.paged_mla_decode(q, rows, tables, seq_lens, kv_lora_rank=RANK, scale=0.3),
                   generic) <= 1e-6


def test_absorbed_decode_equals_the_unabsorbed_attention():
    """``q_h = [q_nope_h · W_UK_h | q_rope_h]`` over latent rows, output times ``W_UV_h``, equals expanding every
    row to per-head keys ``[W_UK_h · c | k_rope]`` and values ``W_UV_h · c`` (transformers' way), within 1e-5."""
    heads, nope, v_dim, lens, block_size = 6, 16, 12, (1, 23, 50), 16
    num_blocks = 10
    _, rows = latent_plane(num_blocks, block_size, torch.device("cpu"), seed=11)
    tables = make_block_tables(lens, block_size, 5, num_blocks, seed=12)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    gen = torch.Generator().manual_seed(13)
    kv_b = torch.randn(heads * (nope + v_dim), RANK, generator=gen) * RANK**-0.5
    q_nope = torch.randn(3, heads, nope, generator=gen)
    q_rope = torch.randn(3, heads, ROPE, generator=gen)
    w = kv_b.view(heads, nope + v_dim, RANK)
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w[:, :nope]), q_rope], dim=-1)
    lat = reference.paged_mla_decode(q_abs, rows, tables, seq_lens, kv_lora_rank=RANK, scale=0.25)
    absorbed = torch.einsum("thr,hvr->thv", lat, w[:, nope:])
    unabsorbed = reference.mla_unabsorbed_attention(q_nope, q_rope, rows, kv_b, tables, seq_lens,
                                                    torch.arange(4, dtype=torch.int32), v_head_dim=v_dim, scale=0.25)
    assert max_err(absorbed, unabsorbed) <= 1e-5


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_gpu_mla_decode_at_deepseek_v3_shapes(dtype, tolerance, no_tf32):
    """DeepSeek-V3's shapes: 128 heads, a latent of 512 + 64, 64-token blocks; ragged lengths to 5k tokens."""
    from kvrelay.kernels import triton_mla

    lens, block_size, device = (1, 700, 5000, 64), 64, torch.device("cuda")
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    _, rows = latent_plane(num_blocks, block_size, device, seed=2, dtype=dtype, width=576)
    tables = make_block_tables(lens, block_size, 80, num_blocks, seed=3).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), 128, 576, generator=torch.Generator().manual_seed(4)).to(rows.dtype).to(device)
    got = triton_mla.paged_mla_decode(q, rows, tables, seq_lens, kv_lora_rank=512, scale=576**-0.5)
    want = reference.paged_mla_decode(q, rows, tables, seq_lens, kv_lora_rank=512, scale=576**-0.5)
    assert max_err(got, want) <= tolerance
