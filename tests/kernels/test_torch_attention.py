"""The batched SDPA attention (the CPU serving path) against `kernels.reference`.

Ragged batches: sequences of different lengths, prefill chunks over cached prefixes of different
lengths (0 included), one-token chunks, block tables with shuffled ids and out-of-range padding.
"""

from __future__ import annotations

import pytest
import torch
from kvrelay.kernels import reference, torch_attention
from kvrelay.kvstore.block_spec import BlockSpec

from tests.kernels.test_triton_attention import PAD_BLOCK_ID, make_block_tables, make_layer

# (num_queries, seq_len) per sequence: ctx = seq_len - num_queries tokens are already cached.
PREFILL_BATCHES = {
    "one-fresh": [(37, 37)],
    "one-over-prefix": [(5, 70)],
    "ragged": [(16, 16), (1, 33), (40, 300), (7, 7), (3, 128)],
    "chunks-over-prefixes": [(32, 288), (32, 288), (288, 288), (1, 1)],
    "grouped-by-length": [(288, 288), (32, 300), (0, 20), (30, 64), (1, 77), (250, 250), (31, 31)],
}
DECODE_LENS = {"one": (1,), "ragged": (1, 17, 300, 64, 5), "equal": (288,) * 8}


def _caches(lens: tuple[int, ...], *, dtype: str, kv_heads: int = 2, head_dim: int = 64, block: int = 16,
            seed: int = 0):
    spec = BlockSpec(num_layers=3, num_kv_heads=kv_heads, head_dim=head_dim, block_size_tokens=block, dtype=dtype)
    num_blocks = sum(-(-n // block) for n in lens) + 3
    _, k_cache, v_cache = make_layer(spec, num_blocks, torch.device("cpu"), seed)
    width = max(-(-n // block) for n in lens) + 2
    tables = make_block_tables(lens, block, width, num_blocks, seed)
    assert (tables == PAD_BLOCK_ID).any()
    return spec, k_cache, v_cache, tables


@pytest.mark.parametrize("name", sorted(PREFILL_BATCHES))
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_equals_reference_fp32(name: str, group: int) -> None:
    parts = PREFILL_BATCHES[name]
    lens = tuple(s for _, s in parts)
    spec, k_cache, v_cache, tables = _caches(lens, dtype="float32")
    starts = torch.tensor([0, *torch.tensor([nq for nq, _ in parts]).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(int(starts[-1]), group * spec.num_kv_heads, spec.head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, seq_lens, starts)
    got = torch_attention.prefill_attention(*args, scale=0.125)
    want = reference.prefill_attention(*args, scale=0.125)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(DECODE_LENS))
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_equals_reference_fp32(name: str, group: int) -> None:
    lens = DECODE_LENS[name]
    spec, k_cache, v_cache, tables = _caches(lens, dtype="float32", seed=len(lens))
    q = torch.randn(len(lens), group * spec.num_kv_heads, spec.head_dim, generator=torch.Generator().manual_seed(4))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = torch_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_bf16_is_close_to_the_reference() -> None:
    """bf16 inputs: SDPA accumulates in float32, as the reference does; only the output rounding differs."""
    lens = DECODE_LENS["ragged"]
    spec, k_cache, v_cache, tables = _caches(lens, dtype="bfloat16", seed=5)
    q = torch.randn(len(lens), 3 * spec.num_kv_heads, spec.head_dim).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = torch_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


def test_token_weights_go_to_the_reference() -> None:
    lens = (20, 3)
    spec, k_cache, v_cache, tables = _caches(lens, dtype="float32", seed=6)
    q = torch.randn(2, 2 * spec.num_kv_heads, spec.head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got_w, want_w = torch.empty(2, spec.num_kv_heads, 20), torch.empty(2, spec.num_kv_heads, 20)
    args = (q, k_cache, v_cache, tables, seq_lens)
    got = torch_attention.paged_decode_attention(*args, scale=0.125, token_weights=got_w)
    want = reference.paged_decode_attention(*args, scale=0.125, token_weights=want_w)
    assert torch.equal(got, want) and torch.equal(got_w, want_w)


def test_padding_groups_bound_the_waste() -> None:
    assert torch_attention._padding_groups([288, 32, 32, 32]) == [[0], [1, 2, 3]]
    assert torch_attention._padding_groups([288, 288, 160]) == [[0, 1, 2]]
    assert torch_attention._padding_groups([1, 0, 40, 7, 3]) == [[2], [3, 4], [0]]
    for q_lens in ([288, 32, 32, 32], [5, 100, 7, 64, 1, 1, 33]):
        for group in torch_attention._padding_groups(q_lens):
            assert len(group) * max(q_lens[i] for i in group) <= 1.5 * sum(q_lens[i] for i in group)


@pytest.mark.parametrize("slots", [[5, 0, 33, 18], [5, -1, 33, -1]], ids=["all-real", "with-padding"])
def test_write_kv_equals_reference(slots: list[int]) -> None:
    spec, k_cache, v_cache, _ = _caches((40,), dtype="bfloat16", seed=9)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    gen = torch.Generator().manual_seed(10)
    key = torch.randn(4, spec.num_kv_heads, spec.head_dim, generator=gen)
    value = torch.randn(4, spec.num_kv_heads, spec.head_dim, generator=gen)
    slot_mapping = torch.tensor(slots)
    torch_attention.write_kv(k_cache, v_cache, key, value, slot_mapping)
    reference.write_kv(ref_k, ref_v, key, value, slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert not torch.equal(k_cache, _caches((40,), dtype="bfloat16", seed=9)[1])  # something was written


def test_the_backend_plans_once_per_step_and_anew_for_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TorchBackend` reuses a step's derived metadata across layers (same tensor objects) and never
    carries it into the next step (new tensors, other lengths)."""
    from kvrelay.model.attention import TorchBackend

    plans: list[tuple[int, ...]] = []
    real = torch_attention.decode_plan
    monkeypatch.setattr(torch_attention, "decode_plan",
                        lambda tables, lens, *rest: plans.append(tuple(lens.tolist())) or real(tables, lens, *rest))
    backend = TorchBackend()
    backend.cpu_decode_kernels = None  # the torch-op path (where the C++ kernel does not build)
    for step, lens in enumerate([(1, 17, 300), (2, 18, 301, 40)]):
        spec, k_cache, v_cache, tables = _caches(lens, dtype="float32", seed=20 + step)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        for layer in range(3):
            q = torch.randn(len(lens), 3 * spec.num_kv_heads, spec.head_dim,
                            generator=torch.Generator().manual_seed(layer))
            got = backend.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
            want = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert plans == [(1, 17, 300), (2, 18, 301, 40)]


def test_the_backend_write_plan_follows_the_slot_mapping() -> None:
    from kvrelay.model.attention import TorchBackend

    backend = TorchBackend()
    spec, k_cache, v_cache, _ = _caches((40,), dtype="float32", seed=9)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    for i, slots in enumerate([[5, 0, 33, 18], [5, -1, 34, -1], [7, 1, 2, 3]]):
        gen = torch.Generator().manual_seed(i)
        key = torch.randn(4, spec.num_kv_heads, spec.head_dim, generator=gen)
        value = torch.randn(4, spec.num_kv_heads, spec.head_dim, generator=gen)
        slot_mapping = torch.tensor(slots)
        for _ in range(2):  # two layers of one step
            backend.write_kv(k_cache, v_cache, key, value, slot_mapping)
            reference.write_kv(ref_k, ref_v, key, value, slot_mapping)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
