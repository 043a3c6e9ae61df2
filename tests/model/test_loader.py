"""`load_model`: single file and shards, tying, dtypes, and errors that name the problem."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from kvrelay.model.loader import load_model, model_fingerprint
from kvrelay.model.tiny import write_tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("loader") / "tiny", seed=3)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(model_dir: Path, edit: dict[str, torch.Tensor | None]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    single, sharded = load_model(tmp_path / "single"), load_model(tmp_path / "sharded")
    assert single.config == sharded.config
    single_params = dict(single.model.named_parameters(remove_duplicate=False))
    sharded_params = dict(sharded.model.named_parameters(remove_duplicate=False))
    assert single_params.keys() == sharded_params.keys()
    for name, p in single_params.items():
        assert torch.equal(p, sharded_params[name]), name
    assert sharded.model.lm_head.weight is sharded.model.model.embed_tokens.weight
    assert single.fingerprint != sharded.fingerprint  # different files, though the same weights


def test_missing_tensor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_dir, tmp_path / "m")
    _rewrite_weights(model_dir, {"model.layers.1.mlp.up_proj.weight": None})
    expected = rf"{model_dir}: the checkpoint has no tensor 'model.layers.1.mlp.up_proj.weight'"
    with pytest.raises(ValueError, match=expected):
        load_model(model_dir)


def test_missing_lm_head_without_tying_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_dir, tmp_path / "m")
    _rewrite_weights(model_dir, {"lm_head.weight": None})
    with pytest.raises(ValueError, match="no tensor 'lm_head.weight'"):
        load_model(model_dir)


def test_misshaped_tensor_is_named_with_both_shapes(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_dir, tmp_path / "m")
    _rewrite_weights(model_dir, {"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})
    with pytest.raises(ValueError) as info:
        load_model(model_dir)
    message = str(info.value)
    assert "'model.layers.0.self_attn.k_proj.weight'" in message
    assert "has shape (16, 64); the model expects (32, 64)" in message
    assert str(model_dir / "model.safetensors") in message


def test_missing_config_json_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_dir, tmp_path / "m")
    (model_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{model_dir}/config.json not found"):
        load_model(model_dir)


def test_missing_weights_and_missing_shard_are_named(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_dir, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_model(model_dir)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="names shard model-00001-of-00002.safetensors, which is missing"):
        load_model(model_dir)


def test_unknown_architecture_lists_supported(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    supported = (r"\['llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe', 'mixtral', 'gpt_oss', 'deepseek_v3', "
                 r"'deepseek_v2'\]")
    with pytest.raises(ValueError, match=r"'phi3'.*" + supported):
        load_model(model_dir)


def test_extra_tensors_are_ignored_and_counted(tiny_dir: Path, tmp_path: Path, caplog) -> None:
    model_dir = _copy(tiny_dir, tmp_path / "m")
    _rewrite_weights(model_dir, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)})
    with caplog.at_level(logging.WARNING, logger="kvrelay.model.loader"):
        loaded = load_model(model_dir)
    assert "ignored 2 checkpoint tensors" in caplog.text
    reference = load_model(tiny_dir)
    for (name, p), (_, q) in zip(loaded.model.named_parameters(), reference.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@torch.inference_mode()
def test_half_precision_load(tiny_dir: Path, dtype: str) -> None:
    loaded = load_model(tiny_dir, dtype=dtype)
    assert {p.dtype for p in loaded.model.parameters()} == {getattr(torch, dtype)}
    assert loaded.model.rope_inv_freq.dtype == torch.float32
    hidden = loaded.model.model.norm(loaded.model.model.embed_tokens(torch.tensor([1, 2])))
    logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_unsupported_dtype_is_named(tiny_dir: Path) -> None:
    expected = r"dtype 'int8' is not supported; use one of \['auto', 'bfloat16', 'float16', 'float32'\]"
    with pytest.raises(ValueError, match=expected):
        load_model(tiny_dir, dtype="int8")


def test_fingerprint_covers_config_and_weights(tiny_dir: Path, tmp_path: Path) -> None:
    base = model_fingerprint(tiny_dir)
    assert len(base) == 64 and base == model_fingerprint(_copy(tiny_dir, tmp_path / "same"))
    edited_config = _copy(tiny_dir, tmp_path / "config")
    config = json.loads((edited_config / "config.json").read_text())
    (edited_config / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    assert model_fingerprint(edited_config) != base
    edited_weights = _copy(tiny_dir, tmp_path / "weights")
    tensors = load_file(str(edited_weights / "model.safetensors"))
    _rewrite_weights(edited_weights, {"lm_head.weight": tensors["lm_head.weight"] + 1e-3})
    assert model_fingerprint(edited_weights) != base


def test_fingerprint_covers_every_weight_byte_and_caches_by_size_and_mtime(tiny_dir: Path, tmp_path: Path) -> None:
    """Issue 13: weights changed in place (one byte in the middle of the file, size unchanged) get a new
    fingerprint; the digest is cached next to the files and redone when the file's mtime moves."""
    import os

    from kvrelay.model.loader import FINGERPRINT_CACHE

    model = _copy(tiny_dir, tmp_path / "m")
    (model / FINGERPRINT_CACHE).unlink(missing_ok=True)
    base = model_fingerprint(model)
    cache = json.loads((model / FINGERPRINT_CACHE).read_text())
    weights = model / "model.safetensors"
    assert cache["model.safetensors"]["size"] == weights.stat().st_size
    assert model_fingerprint(model) == base  # from the cache
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    st = weights.stat()
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    changed = model_fingerprint(model)
    assert changed != base
    assert json.loads((model / FINGERPRINT_CACHE).read_text())["model.safetensors"]["mtime_ns"] == \
        st.st_mtime_ns + 1_000_000
    data[middle] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_fingerprint(model) == base  # the same bytes again: the same name


def test_mxfp4_experts_are_refused_by_name(tmp_path: Path) -> None:
    from kvrelay.model.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "gpt-oss", arch="gpt-oss")
    blocks = torch.zeros(4, 128, 2, 16, dtype=torch.uint8)
    _rewrite_weights(model_dir, {"model.layers.0.mlp.experts.gate_up_proj": None,
                                 "model.layers.0.mlp.experts.gate_up_proj_blocks": blocks})
    with pytest.raises(ValueError, match=r"the experts are stored quantized \('model.layers.0.mlp.experts."
                                         r"gate_up_proj_blocks', MXFP4 as gpt-oss releases them\)"):
        load_model(model_dir)


def test_same_size_weights_with_the_old_mtime_are_hashed_again(tiny_dir: Path, tmp_path: Path) -> None:
    """Issue 30 (9): weights replaced by same-size ones whose mtime is set back (``os.utime``, as ``cp -p``
    and ``rsync -t`` do) used to hit the digest cache, so KV of the old weights was served; the cache is
    also keyed by ctime and inode now."""
    import os
    import shutil

    model = _copy(tiny_dir, tmp_path / "m")
    base = model_fingerprint(model)
    weights = model / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    edited = model_fingerprint(model)
    assert edited != base
    other = _copy(tiny_dir, tmp_path / "other")  # the original bytes, copied over with their metadata
    os.utime(other / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    shutil.copy2(other / "model.safetensors", weights)
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    assert model_fingerprint(model) == base
