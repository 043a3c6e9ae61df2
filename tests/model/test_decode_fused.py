"""`DecoderLayer.decode_fused`, `LlamaForCausalLM.decode_layers` and `LlamaForCausalLM.decode_logits`
(``kernels/csrc/decode_layer.cpp``): bf16 and float32 decode steps of up to `kernels.cpu_small.BLOCKED_MAX_ROWS`
tokens run each layer as one C++ call, every layer in one (``DecodeStack``), or the embedding, every layer and the
head in one, with the bits of the layer's Python path."""

from __future__ import annotations

import pytest
import torch
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.kernels import cpu_small
from kvrelay.model.llama import DecoderLayer, LlamaForCausalLM
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams

# Twenty sequences of ragged prompts (one block of 16 tokens to five) and ragged outputs: the first decode steps
# hold twenty tokens (past BLOCKED_MAX_ROWS: the Python path), later ones sixteen, then fewer as sequences finish.
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)]
           for i, n in enumerate((3, 17, 45, 60, 9, 33, 2, 50, 21, 70) * 2)]


def _generate(model_dir, monkeypatch: pytest.MonkeyPatch, *, path: str, dtype: str = "bfloat16"):
    """Tokens and logprobs of every request, and the row counts of the steps that ran fused: ``path`` "python"
    (no fused step), "layers" (one C++ call a layer: `DecoderLayer.decode_fused`), "stack" (one call a step for
    the layers: `LlamaForCausalLM.decode_layers`, then the head) or "logits" (one call a step for the embedding,
    the layers and the head: `LlamaForCausalLM.decode_logits`)."""
    loaded = load_model(model_dir, dtype=dtype)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=160, enable_prefix_caching=False, kernel_plan="builtin"))
    assert loaded.model.decode_stack is not None and len(loaded.model.decode_stack) == len(loaded.model.model.layers)
    assert loaded.model.stack_norms  # the stack path applies the final norm in its own call
    assert loaded.model.stack_logits  # and can run the embedding and head too
    if path not in ("stack", "logits"):
        loaded.model.decode_stack = None
    loaded.model.stack_logits = path == "logits"
    fused_rows: list[int] = []
    real_layer, real_stack = DecoderLayer.decode_fused, LlamaForCausalLM.decode_layers
    real_logits = LlamaForCausalLM.decode_logits

    def counting_layer(self, x, *args):
        if self.self_attn.layer_idx == 0:
            fused_rows.append(x.shape[0])
        return real_layer(self, x, *args)

    def counting_stack(self, x, *args):
        fused_rows.append(x.shape[0])
        return real_stack(self, x, *args)

    def counting_logits(self, ids, *args):
        fused_rows.append(len(ids))
        return real_logits(self, ids, *args)

    with monkeypatch.context() as m:
        m.setattr(DecoderLayer, "decode_fused", counting_layer)
        m.setattr(LlamaForCausalLM, "decode_layers", counting_stack)
        m.setattr(LlamaForCausalLM, "decode_logits", counting_logits)
        if path == "python":
            m.setattr(LlamaForCausalLM, "_fused_step", staticmethod(lambda *a: False))
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4 + 2 * i, logprobs=3, ignore_eos=True))
        results: dict[str, tuple[list[int], list]] = {f"r{i}": ([], []) for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for out in engine.step():
                results[out.request_id][0].extend(out.new_token_ids)
                results[out.request_id][1].extend(out.logprobs or [])
    return results, fused_rows


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
# plain; q/k/v bias; window; an odd intermediate width (padded rows); a head dim of 32 (the rotary rows tabled)
@pytest.mark.parametrize("name", ["tiny", "qwen2_bias_tied", "mistral_window_40", "llama_odd_intermediate",
                                  "llama_head_dim_32"])
def test_fused_layers_give_the_python_path_s_tokens_and_logprobs(name, dtype, tiny_model_dir, hf_model_dir,
                                                                 monkeypatch) -> None:
    model_dir = tiny_model_dir if name == "tiny" else hf_model_dir(name)
    want, none = _generate(model_dir, monkeypatch, path="python", dtype=dtype)
    assert none == []
    for path in ("layers", "stack", "logits"):
        got, rows = _generate(model_dir, monkeypatch, path=path, dtype=dtype)
        assert got == want, path  # token ids, and each logprob and its alternatives as exact floats
        # fused at every row count from the batch limit down to one; never past it
        assert set(rows) == set(range(1, cpu_small.BLOCKED_MAX_ROWS + 1)), path


@pytest.mark.parametrize("threads", [1, 3])  # no parallel region; a team of three on this machine's two cores
def test_the_stack_gives_the_python_path_s_bits_at_any_thread_count(threads, tiny_model_dir, monkeypatch) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want, _ = _generate(tiny_model_dir, monkeypatch, path="python")
        got, rows = _generate(tiny_model_dir, monkeypatch, path="stack")
        got_logits, rows_logits = _generate(tiny_model_dir, monkeypatch, path="logits")
    finally:
        torch.set_num_threads(before)
    assert got == want and set(rows) == set(range(1, cpu_small.BLOCKED_MAX_ROWS + 1))
    assert got_logits == want and set(rows_logits) == set(range(1, cpu_small.BLOCKED_MAX_ROWS + 1))


def test_only_dense_gqa_layers_in_bf16_or_float32_are_fused(tiny_model_dir, hf_model_dir) -> None:
    for dtype in ("bfloat16", "float32"):
        model = load_model(tiny_model_dir, dtype=dtype).model
        assert all(layer.fused is not None for layer in model.model.layers)
        assert len(model.decode_stack) == len(model.model.layers)
    half = load_model(tiny_model_dir, dtype="float16").model
    assert all(layer.fused is None for layer in half.model.layers) and half.decode_stack is None
    mla = load_model(hf_model_dir("deepseek_v2_group_limited"), dtype="bfloat16").model
    assert all(layer.fused is None for layer in mla.model.layers) and mla.decode_stack is None


def test_bad_inputs_are_refused_by_name_before_any_write(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir, dtype="bfloat16").model
    layer = model.model.layers[0]
    assert layer.fused is not None
    ext, before, after = layer.fused
    cache = torch.zeros(4, 2, 2, 16, 16, dtype=torch.bfloat16)
    x = torch.randn(1, 64).bfloat16()
    cos, sin = torch.ones(1, 16).bfloat16(), torch.zeros(1, 16).bfloat16()
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    slot_0 = torch.zeros(1, dtype=torch.int64)

    def call(x=x, slots=slot_0, cache=cache, cos=cos):
        return ext.decode_layer(x, *before, cos, sin, cache, slots, tables, lens, *after)

    assert call().shape == (1, 64) and cache[0, :, :, 0].abs().sum() > 0  # K and V of slot 0 written
    cache.zero_()
    with pytest.raises(RuntimeError, match="token 0's slot 64 is past the 4 blocks of the cache"):
        call(slots=torch.tensor([64]))
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16 or float32 \\[T, hidden\\]"):
        call(x=x.double())
    with pytest.raises(RuntimeError, match="the norm weights must be contiguous Float \\[hidden\\]"):
        call(x=x.float())  # a float32 x beside this layer's bf16 weights
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous BFloat16 \\[T, head_dim\\]"):
        call(cos=torch.ones(1, 8).bfloat16())
    with pytest.raises(RuntimeError,
                       match="layer_cache must be BFloat16 \\[num_blocks, 2, kv_heads, B, head_dim\\]"):
        call(cache=cache.float())
    # the block tables are checked before the KV write too (the attention would refuse them after it)
    with pytest.raises(RuntimeError, match="sequence 0: block id out of range"):
        ext.decode_layer(x, *before, cos, sin, cache, slot_0, torch.full((1, 1), 4, dtype=torch.int32), lens, *after)
    with pytest.raises(RuntimeError, match="sequence 0: length 17 does not fit its block table"):
        ext.decode_layer(x, *before, cos, sin, cache, slot_0, tables, torch.tensor([17]), *after)
    heads, kv_heads, d, inter = before[-1]
    with pytest.raises(RuntimeError, match=f"heads \\({heads + 1}\\) must be a multiple of kv_heads \\({kv_heads}\\)"):
        ext.decode_layer(x, *before[:-1], [heads + 1, kv_heads, d, inter], cos, sin, cache, slot_0, tables, lens,
                         *after)
    with pytest.raises(RuntimeError, match="window must be >= 1, or 0 for none; got -1"):
        ext.decode_layer(x, *before, cos, sin, cache, slot_0, tables, lens, after[0], -1)
    assert cache.abs().sum() == 0


def test_the_stack_refuses_bad_inputs_by_name_before_any_write(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir, dtype="bfloat16").model
    stack, config = model.decode_stack, model.config
    layers, hidden, d = config.num_hidden_layers, config.hidden_size, config.head_dim
    assert layers > 1 and len(config.kv_groups) == 1
    pool = torch.zeros(4, layers, 2, config.num_key_value_heads, 16, d, dtype=torch.bfloat16)
    x = torch.randn(1, hidden).bfloat16()
    cos, sin = torch.ones(1, d).bfloat16(), torch.zeros(1, d).bfloat16()
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    slot_0 = torch.zeros(1, dtype=torch.int64)

    def call(x=x, pool=pool, slots=(slot_0,), tables=(tables,), lens=(lens,)):
        return stack.forward(x, cos, sin, pool, list(slots), list(tables), list(lens))

    assert call().shape == (1, hidden)
    assert (pool[0, :, :, :, 0].abs().sum(dim=(1, 2, 3)) > 0).all()  # every layer's K and V of slot 0 written
    pool.zero_()
    with pytest.raises(RuntimeError, match="token 0's slot 64 is past the 4 blocks of the cache"):
        call(slots=(torch.tensor([64]),))
    with pytest.raises(RuntimeError, match=f"x must be a contiguous BFloat16 \\[T, {hidden}\\]"):
        call(x=x.float())
    with pytest.raises(RuntimeError, match="kv_pool must be \\[num_blocks, layers, 2, kv_heads, B, head_dim\\]"):
        call(pool=pool[:, 0])
    with pytest.raises(RuntimeError, match="layer 1 reads local layer 1 of kv_pool's 1"):
        call(pool=pool[:, :1])  # layer 0 fits: nothing of it may be written either
    with pytest.raises(RuntimeError, match="one slot mapping, block table and length tensor per KV block group"):
        call(lens=())
    with pytest.raises(RuntimeError, match="layer 0 reads KV block group 0 of 0"):
        call(slots=(), tables=(), lens=())
    # a bad block table is refused before layer 0 writes its KV, not by layer 0's attention after the write
    with pytest.raises(RuntimeError, match="sequence 0: block id out of range"):
        call(tables=(torch.full((1, 1), -1, dtype=torch.int32),))
    with pytest.raises(RuntimeError, match="sequence 0: length 17 does not fit its block table"):
        call(lens=(torch.tensor([17]),))
    with pytest.raises(RuntimeError, match="block_tables must be \\[T, W\\] and seq_lens \\[T\\]"):
        call(tables=(torch.zeros(2, 1, dtype=torch.int32),))
    assert pool.abs().sum() == 0
    ext, before, after = model.model.layers[0].fused
    empty = ext.DecodeStack()
    with pytest.raises(RuntimeError, match="DecodeStack: no layers"):
        empty.forward(x, cos, sin, pool, [slot_0], [tables], [lens])
    norm = model.model.norm.weight
    with pytest.raises(RuntimeError, match="DecodeStack: add the layers before the final norm"):
        empty.set_final_norm(norm, 1e-5)
    empty.add_layer(*before, *after, 0, 0)
    f32 = load_model(tiny_model_dir, dtype="float32").model.model.layers[0].fused[1]
    with pytest.raises(RuntimeError, match="layer 1 is not BFloat16 of hidden size"):
        empty.add_layer(*f32, *after, 0, 1)
    assert len(empty) == 1
    for bad in (norm.float(), norm[:-1].contiguous(), torch.stack([norm, norm], 1)[:, 0]):
        with pytest.raises(RuntimeError, match=f"the final norm weight must be contiguous BFloat16 \\[{hidden}\\]"):
            empty.set_final_norm(bad, 1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_stack_s_logits_are_forward_then_the_head_and_bad_ids_are_refused_before_any_write(
        dtype, tiny_model_dir) -> None:
    model = load_model(tiny_model_dir, dtype=dtype).model
    stack, config = model.decode_stack, model.config
    vocab, hidden, d = config.vocab_size, config.hidden_size, config.head_dim
    pool = torch.zeros(4, config.num_hidden_layers, 2, config.num_key_value_heads, 16, d,
                       dtype=model.lm_head.weight.dtype)
    ids, positions = [5, 17, vocab - 1], [0, 3, 9]
    cos, sin = model.rotary(torch.tensor(positions), pool.dtype)
    table = model.rotary(torch.arange(12), pool.dtype)  # rows 0 .. 11: a token's row is its position
    step = ([torch.tensor([0, 19, 41])], [torch.tensor([[0], [1], [2]], dtype=torch.int32)], [torch.tensor([1, 4, 10])])
    lists = ([[0, 19, 41]], [[[0], [1], [2]]], [1, 4, 10])  # the same step as `logits` takes it
    want_pool = pool.clone()
    with torch.inference_mode():
        want = model.compute_logits(stack.forward(model.model.embed_tokens(torch.tensor(ids)), cos, sin, want_pool,
                                                  *step))
    got, greedy = stack.logits(ids, positions, *table, pool, *lists)
    assert got.dtype == torch.float32 and got.shape == (3, vocab)
    assert torch.equal(got, want) and torch.equal(pool, want_pool)  # the same logits bits, the same KV written
    assert greedy == torch.argmax(want, dim=-1).tolist()
    pool.zero_()
    with pytest.raises(RuntimeError, match=f"token 1's id {vocab} is outside the {vocab} rows of the embedding"):
        stack.logits([5, vocab, 3], positions, *table, pool, *lists)
    with pytest.raises(RuntimeError, match="token 0's id -1 is outside"):
        stack.logits([-1, 2, 3], positions, *table, pool, *lists)
    with pytest.raises(RuntimeError, match="token 2's rotary row 12 is outside the 12 rows of the tables"):
        stack.logits(ids, [0, 3, 12], *table, pool, *lists)
    with pytest.raises(RuntimeError, match="one rotary row per token id"):
        stack.logits(ids, positions[:2], *table, pool, *lists)
    with pytest.raises(RuntimeError, match="the rotary tables must be contiguous"):
        stack.logits(ids, positions, table[0].half(), table[1].half(), pool, *lists)
    with pytest.raises(RuntimeError, match="token 2's slot 64 is past the 4 blocks of the cache"):
        stack.logits(ids, positions, *table, pool, [[0, 19, 64]], *lists[1:])
    with pytest.raises(RuntimeError, match="sequence 1: block id out of range \\(-1\\)"):
        stack.logits(ids, positions, *table, pool, lists[0], [[[0], [-1], [2]]], lists[2])
    with pytest.raises(RuntimeError, match="sequence 2: length 17 does not fit its block table"):
        stack.logits(ids, positions, *table, pool, lists[0], lists[1], [1, 4, 17])
    with pytest.raises(RuntimeError, match="one KV length per token id"):
        stack.logits(ids, positions, *table, pool, *lists[:2], [1, 4])
    with pytest.raises(RuntimeError, match="KV block group 0 needs one slot and one block table per token id"):
        stack.logits(ids, positions, *table, pool, lists[0], [[[0], [1]]], lists[2])
    with pytest.raises(RuntimeError, match="one slot list and table list per KV block group"):
        stack.logits(ids, positions, *table, pool, lists[0], [], lists[2])
    with pytest.raises(RuntimeError, match="layer_cache must be .* \\[num_blocks, 2, kv_heads, B, head_dim\\]"):
        stack.logits(ids, positions, *table, pool.half(), *lists)  # each layer's slice of the pool, checked
    assert pool.abs().sum() == 0
    # ragged tables are padded: a longer table in one row changes nothing another row reads
    got_ragged, _ = stack.logits(ids, positions, *table, pool, lists[0], [[[0], [1, 3], [2]]], lists[2])
    assert torch.equal(got_ragged, want) and torch.equal(pool, want_pool)
    pool.zero_()
    ext, before, after = model.model.layers[0].fused
    empty = ext.DecodeStack()
    empty.add_layer(*before, *after, 0, 0)
    with pytest.raises(RuntimeError, match="no embedding and head \\(set_ends\\)"):
        empty.logits(ids, positions, *table, pool, *lists)
    embedding, head_w = model.model.embed_tokens.weight, model.head.blocked
    with pytest.raises(RuntimeError, match="set the final norm before the embedding and head"):
        empty.set_ends(embedding, head_w, vocab)
    empty.set_final_norm(model.model.norm.weight, 1e-5)
    with pytest.raises(RuntimeError, match=f"the embedding must be contiguous .* \\[vocab, {hidden}\\]"):
        empty.set_ends(embedding[:, :-1].contiguous(), head_w, vocab)
    with pytest.raises(RuntimeError, match=f"head_w must be a blocked .* weight of {vocab + 16} x {hidden}"):
        empty.set_ends(embedding, head_w, vocab + 16)
    assert not empty.has_ends() and stack.has_ends()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_stack_s_greedy_tokens_are_torch_s_argmax_with_ties_and_nans(threads, tiny_model_dir) -> None:
    """Each row's greedy token from `DecodeStack.logits` is ``torch.argmax``'s: the first of equal maxima, the first
    NaN over any number, wherever the columns fall in the team's split (head rows crafted to tie or be NaN)."""
    model = load_model(tiny_model_dir, dtype="bfloat16").model
    config = model.config
    vocab, d = config.vocab_size, config.head_dim
    assert vocab >= 256
    ids, positions = [5, 17, 99], [0, 3, 9]
    step = ([[0, 19, 41]], [[[0], [1], [2]]], [1, 4, 10])
    w = model.lm_head.weight.detach()
    zeros = torch.zeros_like(w)  # every logit 0.0: column 0
    tie = zeros.clone()  # logits 0.0 but two equal ones: whichever ties at the maximum, the first column wins
    tie[7], tie[vocab - 40] = w[7], w[7]
    nan_both, nan_late = w.clone(), w.clone()
    nan_both[40], nan_both[vocab - 30] = float("nan"), float("nan")  # the first NaN wins, in either thread's share
    nan_late[vocab - 30] = float("nan")  # a NaN in the last columns ranks above the finite maximum before it
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for head, want_first in ((w, None), (tie, None), (zeros, 0), (nan_both, 40), (nan_late, vocab - 30)):
            stack = model.model.layers[0].fused[0].DecodeStack()
            for i, layer in enumerate(model.model.layers):
                stack.add_layer(*layer.fused[1], *layer.fused[2], *model.kv_place[i])
            stack.set_final_norm(model.model.norm.weight, model.model.norm.eps)
            stack.set_ends(model.model.embed_tokens.weight, cpu_small.block_weight(head), vocab)
            pool = torch.zeros(4, config.num_hidden_layers, 2, config.num_key_value_heads, 16, d, dtype=torch.bfloat16)
            logits, greedy = stack.logits(ids, positions, *model.rotary(torch.arange(10), torch.bfloat16), pool, *step)
            assert greedy == torch.argmax(logits, dim=-1).tolist()
            if head is tie:
                assert torch.equal(logits[:, 7], logits[:, vocab - 40])
            if want_first is not None:
                assert greedy == [want_first] * 3
    finally:
        torch.set_num_threads(before)


def test_a_team_of_two_gives_the_same_bits_wherever_it_cuts_the_linear_layers(tiny_model_dir) -> None:
    """`DecodeStack`'s team of two splits each kind of linear layer where the two threads' measured speeds put the
    cut (``cuts``, kept in 0.2 .. 0.8): the logits, the greedy tokens and the KV written are the same at any cut."""
    model = load_model(tiny_model_dir, dtype="bfloat16").model
    stack, config = model.decode_stack, model.config
    ids, positions = [5, 17, 99], [0, 3, 9]
    table = model.rotary(torch.arange(10), torch.bfloat16)
    step = ([[0, 19, 41]], [[[0], [1], [2]]], [1, 4, 10])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        for cuts in ([500] * 5, [200] * 5, [800] * 5, [200, 800, 350, 650, 777]):
            stack.set_cuts(cuts)
            pool = torch.zeros(4, config.num_hidden_layers, 2, config.num_key_value_heads, 16, config.head_dim,
                               dtype=torch.bfloat16)
            logits, greedy = stack.logits(ids, positions, *table, pool, *step)
            results.append((logits, greedy, pool))
            assert all(200 <= c <= 800 for c in stack.cuts())  # never past the bounds
            if cuts == [200] * 5:  # both threads measured: each cut moves halfway to where their speeds meet
                assert all(c > 200 for c in stack.cuts())
    finally:
        torch.set_num_threads(before)
    for logits, greedy, pool in results[1:]:
        assert torch.equal(logits, results[0][0]) and greedy == results[0][1] and torch.equal(pool, results[0][2])
    with pytest.raises(RuntimeError, match="one cut for each of the 5 kinds of linear layer"):
        stack.set_cuts([500] * 4)
    with pytest.raises(RuntimeError, match="a cut must lie in 200 .. 800 thousandths; got 900"):
        stack.set_cuts([500, 500, 900, 500, 500])


def test_decode_weights_are_moved_onto_huge_pages_in_the_order_a_step_reads_them(tiny_model_dir,
                                                                                monkeypatch) -> None:
    """`LlamaForCausalLM.prepare_for_inference` puts every blocked few-row copy into one buffer
    (`model.linear_kernel.colocate_blocked`): back to back, layer by layer (qkv, o, gate/up, down), then the
    head, with the values `block_weight` gives, and the fused layers read those copies."""
    model = load_model(tiny_model_dir, dtype="bfloat16").model
    layers = model.model.layers
    kernels = [k for layer in layers for k in (layer.self_attn.qkv, layer.self_attn.out, layer.ffn.gate_up,
                                                layer.ffn.down)] + [model.head]
    assert kernels[0].blocked.data_ptr() % cpu_small.HUGE_PAGE == 0
    for a, b in zip(kernels, kernels[1:], strict=False):
        assert b.blocked.data_ptr() == a.blocked.data_ptr() + a.blocked.numel() * a.blocked.element_size()
    for k in kernels:
        assert torch.equal(k.blocked, cpu_small.block_weight(k.weight))
    for layer in layers:
        before = layer.fused[1]
        assert [before[i].data_ptr() for i in (3, 5, 7, 9)] == [
            k.blocked.data_ptr() for k in (layer.self_attn.qkv, layer.self_attn.out, layer.ffn.gate_up,
                                           layer.ffn.down)]
    # the same tokens and logprobs, bit for bit, as with the copies where block_weight left them
    got, _ = _generate(tiny_model_dir, monkeypatch, path="stack")
    monkeypatch.setattr("kvrelay.model.llama.colocate_blocked", lambda kernels: False)
    want, _ = _generate(tiny_model_dir, monkeypatch, path="stack")
    assert got == want
