"""InfiniGen skewing tables: exact under rotary, concentrating, speculating layer i+1 from layer i, and never
used for another model or fraction."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from kvrelay.model.attention import make_backend
from kvrelay.model.llama import LlamaForCausalLM
from kvrelay.model.loader import LoadedModel, load_model
from kvrelay.model.rope import rotary_cos_sin
from kvrelay.model.skew import (
    SkewTables,
    compute_skew,
    layer_inputs,
    load_skew,
    num_partial_channels,
    partial_keys,
    partial_query,
    rotary_key,
    save_skew,
    skew_path,
    speculation_query,
)
from kvrelay.model.tiny import write_tiny_model
from kvrelay.model.tokenizer import load_tokenizer
from safetensors.torch import load_file, save_file

from tests.model.paged_steps import PrefillPart, make_batch, new_pool

SMOLLM2_DIR = Path(__file__).resolve().parents[2] / ".models" / "smollm2-135m-instruct"

# Two unrelated passages: the tables are computed on the first, recall is measured on the second.
CALIBRATION_TEXT = """\
The lighthouse at the end of the northern breakwater was built in 1871, after three ships were lost on the
reef in a single winter. Its first keeper, a retired sailor named Thomas Avery, kept a logbook in which he
recorded the weather every four hours, the ships that passed, and the amount of oil burned each night. The
lamp was a ring of wicks inside a Fresnel lens, a beehive of glass prisms that bent the light into a narrow
beam. A clockwork mechanism, wound by hand every few hours, turned the lens so that the beam swept the sea
once every thirty seconds. Sailors learned to recognise each lighthouse by its rhythm: two short flashes
and a long one meant the harbour mouth, a steady red light meant the rocks to the east.
In fog the light was useless, so a bell was hung from the gallery and rung by a second clockwork. Later a
steam horn replaced the bell, and the keepers complained that it shook the plates from the shelves. Avery
served for twenty-six years. His daughter Margaret took over when his eyesight failed, and she is
remembered for rowing out alone during the storm of 1899 to reach a fishing boat that had capsized near the
point. Two of the four fishermen survived. The harbour commission gave her a silver medal and a raise of
ten pounds a year, which she spent on a new stove for the keeper's cottage.
Electric light arrived in 1934. The clockwork was kept as a spare, then removed, and the lens now stands in
the town museum, where children press their faces against the prisms to see the room turned upside down.
The tower itself was automated in 1987, and for the first time in more than a century nobody lived on the
breakwater. Today the beam is produced by a small array of light-emitting diodes that uses less power than
a kettle, and it is monitored from an office forty miles away. Each spring volunteers repaint the tower in
its original colours, white with a single black band, and on one weekend a year the door is opened and
visitors can climb the one hundred and twelve steps to the gallery.
From the top you can see the whole bay: the fishing fleet, the ferry to the islands, the wind turbines on
the far ridge, and, on a clear evening, the faint flash of the next lighthouse along the coast, still
keeping its own rhythm, two short and one long, as it has for a hundred and fifty years.
"""

EVALUATION_TEXT = """\
To make a simple country loaf you need only flour, water, salt and a starter, but you also need patience.
Begin the evening before by feeding the starter with equal weights of flour and water, and leave it in a
warm corner of the kitchen. By morning it should have doubled and smell pleasantly sour, with bubbles
breaking on the surface. Mix seven hundred grams of water with one hundred and fifty grams of the starter,
then add a kilogram of flour, mostly white with a handful of whole wheat for flavour. Stir until no dry
flour remains, cover the bowl, and let it rest for half an hour. This pause lets the flour absorb the water
and the gluten begin to form on its own.
Next add twenty grams of salt and a splash more water, and squeeze the dough between your fingers until the
salt disappears. Over the next three hours, every thirty minutes, reach under one side of the dough, stretch
it upward and fold it over the top, then turn the bowl and repeat on each side. The dough will change from a
shaggy mass into something smooth and elastic that holds its shape. When it has grown by about half and
feels airy, tip it onto the counter, divide it in two, and shape each piece into a loose round.
After a short rest, shape the loaves properly: fold the edges toward the middle, roll the dough toward you
to build tension in the surface, and place each loaf seam side up in a basket dusted with rice flour. Cover
the baskets and put them in the refrigerator overnight. The cold slows the yeast and gives the bacteria time
to develop the flavour that makes the bread worth the wait.
The next day, heat the oven as hot as it will go with a heavy cast iron pot inside. Turn a loaf out onto a
piece of paper, cut a long shallow slash across the top with a razor, and lower it into the pot. Bake with
the lid on for twenty minutes, so the steam trapped inside keeps the crust soft while the loaf expands, then
remove the lid and bake for another twenty-five minutes until the crust is deep brown. Resist cutting it
at once: the inside is still cooking, and the loaf needs an hour on a rack before the crumb sets.
Good bread rewards attention more than strength. Watch the dough rather than the clock, write down what you
changed each time, and after a few weeks you will know by touch when it is ready.
"""


def _tiny_dir(tmp: Path, *, concentrated: bool) -> Path:
    """A random tiny model (hidden 128, Hq 4, Hkv 2, D 32, 3 layers). ``concentrated``: every KV head's
    queries and keys also get a strong component along one direction spread over the slowest rotary pairs'
    channels (as real models' q/k concentrate in low-frequency channels), not along any single channel."""
    out = write_tiny_model(tmp, seed=0, layers=3, hidden=128, heads=4, kv_heads=2)
    if not concentrated:
        return out
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    dim, hidden, group = 32, 128, 2
    slow = torch.cat([torch.arange(dim // 4, dim // 2), torch.arange(3 * dim // 4, dim)])
    for layer in range(3):
        wq = weights[f"model.layers.{layer}.self_attn.q_proj.weight"]
        wk = weights[f"model.layers.{layer}.self_attn.k_proj.weight"]
        for kv in range(2):
            u = torch.zeros(dim)
            u[slow] = torch.randn(len(slow), generator=gen)
            u /= u.norm()
            for w, head in [(wk, kv)] + [(wq, kv * group + g) for g in range(group)]:
                rows = slice(head * dim, (head + 1) * dim)
                w[rows] = 0.3 * w[rows] + torch.outer(u, torch.randn(hidden, generator=gen) * 8 * hidden**-0.5)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(_tiny_dir(tmp_path_factory.mktemp("skew") / "random", concentrated=False))


@pytest.fixture(scope="module")
def tiny_tables(tiny: LoadedModel) -> SkewTables:
    return compute_skew(tiny, list(CALIBRATION_TEXT.encode())[:512], partial_frac=0.25)


class Activations(NamedTuple):
    """One forward's layer inputs ``xs [L, T, hidden]`` and each layer's exact rotary ``qs[l] [T, Hq, D]`` and
    ``ks[l] [T, Hkv, D]``."""

    xs: torch.Tensor
    qs: list[torch.Tensor]
    ks: list[torch.Tensor]


def _activations(model: LlamaForCausalLM, token_ids: list[int]) -> Activations:
    xs = layer_inputs(model, token_ids)
    cos_sin = rotary_cos_sin(model.rope_inv_freq, torch.arange(len(token_ids)), dtype=xs.dtype)
    with torch.inference_mode():
        qs = [speculation_query(model, i, x, cos_sin) for i, x in enumerate(xs)]
        ks = [rotary_key(model, i, x, cos_sin) for i, x in enumerate(xs)]
    return Activations(xs, qs, ks)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [Tq, Hq, d] · k [S, Hkv, d]`` → float32 ``[Hq, Tq, S]`` (query head j reads KV head j // G)."""
    return torch.einsum("qhd,shd->hqs", q.float(), k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1))


def _speculation_recall(model: LlamaForCausalLM, tables: SkewTables, acts: Activations, *, first_layer: int,
                        num_queries: int, top_k: int) -> float:
    """Mean, over layers ``l >= first_layer``, the last ``num_queries`` positions and every query head, of the
    share of layer ``l``'s exact top-``top_k`` keys (by ``q·k``, causal) found in the top-``top_k`` by partial
    score, the partial query speculated from layer ``l - 1``'s input."""
    xs, qs, ks = acts
    t = xs.shape[1]
    cos_sin = rotary_cos_sin(model.rope_inv_freq, torch.arange(t), dtype=xs.dtype)
    future = torch.arange(t)[None, :] > torch.arange(t - num_queries, t)[:, None]
    recalls = []
    for layer in range(first_layer, len(xs)):
        with torch.inference_mode():
            guess = speculation_query(model, layer, xs[layer - 1], cos_sin)[t - num_queries:]
        exact = _scores(qs[layer][t - num_queries:], ks[layer]).masked_fill(future, float("-inf"))
        partial = _scores(partial_query(tables, layer, guess), partial_keys(tables, layer, ks[layer]))
        want = exact.topk(top_k, dim=-1).indices
        got = partial.masked_fill(future, float("-inf")).topk(top_k, dim=-1).indices
        recalls.append((got[..., :, None] == want[..., None, :]).any(dim=-1).float().mean())
    return float(torch.stack(recalls).mean())


def _score_shares(
    tables: SkewTables, layer: int, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the share of the causal q·k score energy the partial scores reproduce,
    ``1 - |S - S_partial|² / |S|²`` over the group's heads and every pair ``s <= t``: with the selected skewed
    channels, and with the best of two choices of as many unskewed channels (the largest column sums of
    ``|q|``, or of ``|q|`` times those of ``|k|``). Two ``[Hkv]`` float32 tensors."""
    t, kv_heads, dim = k.shape
    q, k = q.float(), k.float()
    future = torch.arange(t)[None, :] > torch.arange(t)[:, None]
    full = _scores(q, k).masked_fill(future, 0.0)

    def captured(proj: torch.Tensor) -> torch.Tensor:  # proj [Hkv, D, R]
        qp = torch.einsum("thd,hdr->thr", q, proj.repeat_interleave(q.shape[1] // kv_heads, dim=0))
        err = (full - _scores(qp, torch.einsum("thd,hdr->thr", k, proj)).masked_fill(future, 0.0)).pow(2)
        return 1 - err.reshape(kv_heads, -1).sum(1) / full.pow(2).reshape(kv_heads, -1).sum(1)

    q_mass = q.reshape(t, kv_heads, -1, dim).abs().sum(dim=(0, 2))  # [Hkv, D]
    eye = torch.eye(dim)
    plain = [captured(eye[:, mass.topk(tables.num_channels, dim=1).indices].permute(1, 0, 2))
             for mass in (q_mass, q_mass * k.abs().sum(0))]
    skewed = torch.gather(tables.rotations[layer], 2, tables.channels[layer][:, None, :].expand(-1, dim, -1))
    return captured(skewed), torch.maximum(*plain)


def _unskewed(tables: SkewTables, calibration: Activations) -> SkewTables:
    """``tables`` without the skew: identity rotations, and per layer and KV head the ``R`` channels with the
    largest column sums of ``|q|`` over the calibration activations (the same rule, unrotated)."""
    layers, kv_heads, dim, _ = tables.rotations.shape
    channels = torch.stack([q.float().reshape(q.shape[0], kv_heads, -1, dim).abs().sum(dim=(0, 2))
                            .topk(tables.num_channels, dim=1).indices.sort(dim=1).values for q in calibration.qs])
    return SkewTables(rotations=torch.eye(dim).expand(layers, kv_heads, dim, dim).contiguous(), channels=channels,
                      partial_frac=tables.partial_frac, model_fingerprint=tables.model_fingerprint)


def test_rotations_are_orthogonal_and_scores_exact(tiny: LoadedModel, tiny_tables: SkewTables) -> None:
    config = tiny.config
    assert tiny_tables.rotations.dtype == torch.float32
    assert tiny_tables.rotations.shape == (3, 2, 32, 32)
    assert tiny_tables.channels.dtype == torch.int64 and tiny_tables.channels.shape == (3, 2, 8)
    assert tiny_tables.model_fingerprint == tiny.fingerprint and tiny_tables.partial_frac == 0.25
    eye = torch.eye(config.head_dim).expand(3, 2, -1, -1)
    torch.testing.assert_close(tiny_tables.rotations @ tiny_tables.rotations.transpose(-1, -2), eye, atol=1e-5, rtol=0)
    _, qs, ks = _activations(tiny.model, list(EVALUATION_TEXT.encode())[:256])
    full = compute_skew(tiny, list(CALIBRATION_TEXT.encode())[:512], partial_frac=1.0)  # every channel kept
    assert torch.equal(full.rotations, tiny_tables.rotations) and full.channels.shape == (3, 2, 32)
    for layer in range(config.num_hidden_layers):
        exact = _scores(qs[layer], ks[layer])
        skewed = _scores(partial_query(full, layer, qs[layer]), partial_keys(full, layer, ks[layer]))
        torch.testing.assert_close(skewed, exact, atol=1e-4, rtol=1e-5)
        # the partial score is the skewed score restricted to the kept channels of the group's KV head
        rot, ch = tiny_tables.rotations[layer], tiny_tables.channels[layer]
        q1, k0 = qs[layer][:, 1:2].float() @ rot[0], ks[layer][:, 0:1].float() @ rot[0]  # head 1 is in group 0
        torch.testing.assert_close(_scores(partial_query(tiny_tables, layer, qs[layer]),
                                           partial_keys(tiny_tables, layer, ks[layer]))[1],
                                   _scores(q1[..., ch[0]], k0[..., ch[0]])[0], atol=1e-4, rtol=1e-5)


def test_layer_inputs_give_the_keys_the_model_writes(tiny: LoadedModel) -> None:
    ids = list(EVALUATION_TEXT.encode())[:40]
    pool = new_pool(tiny.config, 3)
    batch, positions = make_batch([PrefillPart([2, 0, 1], 0, len(ids))], [])
    with torch.inference_mode():
        tiny.model(torch.tensor(ids), positions, pool, batch, make_backend("reference"))
    ks = _activations(tiny.model, ids).ks
    for layer, k in enumerate(ks):
        written = pool[[2, 0, 1], layer, 0].permute(0, 2, 1, 3).reshape(48, 2, 32)[: len(ids)]  # [T, Hkv, D]
        torch.testing.assert_close(k, written, atol=1e-5, rtol=1e-5)


def test_skewed_channels_carry_more_score_mass(tmp_path: Path) -> None:
    loaded = load_model(_tiny_dir(tmp_path / "concentrated", concentrated=True))
    tables = compute_skew(loaded, list(CALIBRATION_TEXT.encode())[:512], partial_frac=0.25)
    _, qs, ks = _activations(loaded.model, list(EVALUATION_TEXT.encode())[:512])
    for layer in range(3):
        skewed, plain = _score_shares(tables, layer, qs[layer], ks[layer])
        # measured: the skewed channels miss 0.04-0.23% of the score energy, the best unskewed ones 0.9-2.5%
        assert bool((1 - skewed <= 0.5 * (1 - plain)).all()), (layer, skewed, plain)


def test_speculation_recall_tiny(tiny: LoadedModel, tiny_tables: SkewTables) -> None:
    # 16 of 449-512 visible keys by chance: 0.03. Measured 0.19 (random weights spread q·k over all 32 channels).
    acts = _activations(tiny.model, list(EVALUATION_TEXT.encode())[:512])
    recall = _speculation_recall(tiny.model, tiny_tables, acts, first_layer=1, num_queries=64, top_k=16)
    assert recall >= 0.15, recall


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2_DIR.is_dir(), reason=f"{SMOLLM2_DIR} absent (kvrelay model pull smollm2-135m-instruct)")
def test_speculation_recall_smollm2() -> None:
    loaded = load_model(SMOLLM2_DIR)
    tok = load_tokenizer(SMOLLM2_DIR)
    tables = compute_skew(loaded, tok.encode(CALIBRATION_TEXT), partial_frac=0.25)
    acts = _activations(loaded.model, tok.encode(EVALUATION_TEXT))
    # InfiniGen runs layers 0 and 1 dense; layer l >= 2 is speculated from layer l - 1's input.
    recall = _speculation_recall(loaded.model, tables, acts, first_layer=2, num_queries=64, top_k=32)
    assert recall >= 0.70, recall  # measured 0.74 (R = 16 of 64 channels, top 32 of 456-519 visible keys)
    plain = _unskewed(tables, _activations(loaded.model, tok.encode(CALIBRATION_TEXT)))
    recall_plain = _speculation_recall(loaded.model, plain, acts, first_layer=2, num_queries=64, top_k=32)
    assert recall >= recall_plain + 0.03, (recall, recall_plain)  # measured 0.74 against 0.67
    skewed, unskewed = zip(*(_score_shares(tables, layer, acts.qs[layer], acts.ks[layer]) for layer in range(2, 30)))
    # measured: 0.918 against 0.902 on average; per layer and KV head the skew wins 65% of the time
    assert float(torch.stack(skewed).mean()) > float(torch.stack(unskewed).mean()) + 0.01


def test_save_load_round_trip_and_refusals(tiny: LoadedModel, tiny_tables: SkewTables, tmp_path: Path) -> None:
    fp = tiny.fingerprint
    path = skew_path(tmp_path, fp, 0.25)
    assert path == tmp_path / f"infinigen-skew-{fp[:16]}-r0.25.safetensors"
    assert skew_path(tmp_path, fp, 0.3).name == f"infinigen-skew-{fp[:16]}-r0.3.safetensors"
    assert load_skew(path, model_fingerprint=fp, partial_frac=0.25) is None
    save_skew(tiny_tables, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    got = load_skew(path, model_fingerprint=fp, partial_frac=0.25)
    assert got is not None
    assert torch.equal(got.rotations, tiny_tables.rotations) and torch.equal(got.channels, tiny_tables.channels)
    assert (got.partial_frac, got.model_fingerprint) == (0.25, fp)
    assert torch.equal(got.to("cpu").channels, got.channels)
    with pytest.raises(ValueError, match="computed for model"):
        load_skew(path, model_fingerprint="0" * 64, partial_frac=0.25)
    with pytest.raises(ValueError, match="partial_frac 0.25, not 0.3"):
        load_skew(path, model_fingerprint=fp, partial_frac=0.3)
    bent = tiny_tables.rotations.clone()
    bent[1, 0, 3, 3] += 0.01
    with pytest.raises(ValueError, match="not orthogonal"):
        replace(tiny_tables, rotations=bent).check_integrity()
    save_file({"rotations": bent, "channels": tiny_tables.channels}, str(path),
              metadata={"format": "kvrelay.infinigen-skew.v1", "model_fingerprint": fp, "partial_frac": "0.25"})
    with pytest.raises(ValueError, match="not orthogonal"):
        load_skew(path, model_fingerprint=fp, partial_frac=0.25)
    path.write_bytes(b"\x08" + bytes(20))
    with pytest.raises(ValueError, match="not a readable skew file"):
        load_skew(path, model_fingerprint=fp, partial_frac=0.25)


def test_partial_frac_is_checked(tiny: LoadedModel) -> None:
    assert [num_partial_channels(64, f) for f in (0.25, 0.3, 0.001, 1.0)] == [16, 19, 1, 64]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"partial_frac must be in \(0, 1\]"):
            compute_skew(tiny, [1, 2, 3], partial_frac=bad)
    with pytest.raises(ValueError, match="token_ids is empty"):
        compute_skew(tiny, [], partial_frac=0.25)
