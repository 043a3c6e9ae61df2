"""InfiniGen's skewed partial keys (OSDI'24): an offline rotation per layer and KV head that packs most of
the q·k score into a few channels, and the choice of those channels.

Exact under rotary: queries and keys are skewed *after* rotary by an orthogonal ``A`` ``[D, D]``, so
``(q A)·(k A) = q·k``; the query heads of a GQA group share their KV head's ``A``. With the ``R``
selected channels ``c`` of the skewed space::

    full score      q·k      = sum over all D channels j of (qA)_j (kA)_j
    partial score   q_p·k_p  = sum over j in c            of (qA)_j (kA)_j
                    q_p = partial_query(q), k_p = partial_keys(k)

At run time the engine keeps ``k_p`` (the partial key cache) beside the full KV and, while layer ``i``
runs, speculates layer ``i+1``'s important tokens from ``partial_query(speculation_query(i+1, x_i))``
against layer ``i+1``'s ``k_p``, where ``x_i`` is layer ``i``'s input (the residual stream).

How the tables are made (`compute_skew`), as InfiniGen's Llama code does: one dense forward over a
calibration text; per layer and KV head, the rotary queries of the group's heads stacked, ``Q [G*T, D]``,
and ``Q = U S Vᵀ`` (SVD): ``A = V``, so ``Q A = U S`` has its energy in the leading channels. The
channels kept are the ``R`` with the largest column sums of ``|Q A|`` (InfiniGen's choice; weighting each
by ``|K A|``'s column sum too measured the same, within a point of recall, on SmolLM2-135M). The tables
name the weights they were made for (`LoadedModel.fingerprint`); `load_skew` refuses them for any other
weights or fraction.

Left to the engine (what InfiniGen does): layers 0 and 1 run dense; a speculated row's tokens are those
whose partial score is within ``alpha`` of the row's maximum (alpha 4-5 on ``q·k / sqrt(D)``), their count
averaged over heads and capped (20% of the context, or a fixed 400 tokens).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from kvrelay.model.attention import AttentionBatch, make_backend
from kvrelay.model.llama import LlamaForCausalLM
from kvrelay.model.loader import LoadedModel
from kvrelay.model.rope import apply_rotary
from kvrelay.model.tokenizer import load_tokenizer
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)
CALIBRATION_TEXT = Path(__file__).parent / "texts" / "alice_chapter_3.txt"  # provenance: texts/README.md
CALIBRATION_TOKENS = 2048

SKEW_FORMAT = "kvrelay.infinigen-skew.v1"
ORTHOGONALITY_TOLERANCE = 1e-4


def num_partial_channels(head_dim: int, partial_frac: float) -> int:
    """``R = max(1, round(partial_frac * head_dim))``.

    Raises:
        ValueError: ``partial_frac`` is not in ``(0, 1]``.
    """
    if not 0.0 < partial_frac <= 1.0:
        raise ValueError(f"partial_frac must be in (0, 1], got {partial_frac}; e.g. 0.25 keeps a quarter of head_dim")
    return max(1, round(partial_frac * head_dim))


@dataclass(frozen=True, slots=True)
class SkewTables:
    """One model's skewing rotations and partial channels.

    Attributes:
        rotations: ``[L, Hkv, D, D]`` float32, each ``[l, h]`` orthogonal; column ``j`` is skewed channel ``j``.
        channels: ``[L, Hkv, R]`` int64, the skewed channels kept in the partial key cache, ascending.
        partial_frac: ``R = num_partial_channels(D, partial_frac)``.
        model_fingerprint: `LoadedModel.fingerprint` of the weights they were computed for.
    """

    rotations: torch.Tensor
    channels: torch.Tensor
    partial_frac: float
    model_fingerprint: str

    @property
    def num_channels(self) -> int:
        """``R``, the channels per KV head in the partial key cache."""
        return int(self.channels.shape[-1])

    def to(self, device: str | torch.device) -> SkewTables:
        """The same tables on ``device`` (move them once, next to the KV pool; the functions below copy
        them to the activations' device on every call otherwise)."""
        return replace(self, rotations=self.rotations.to(device), channels=self.channels.to(device))

    def check_integrity(self) -> None:
        """Raise ValueError unless dtypes, shapes, channel ranges and orthogonality are as documented."""
        rot, ch = self.rotations, self.channels
        if rot.dtype != torch.float32 or rot.dim() != 4 or rot.shape[-1] != rot.shape[-2]:
            raise ValueError(f"rotations must be float32 [L, Hkv, D, D], got {rot.dtype} {tuple(rot.shape)}")
        layers, kv_heads, dim = rot.shape[0], rot.shape[1], rot.shape[-1]
        want = (layers, kv_heads, num_partial_channels(dim, self.partial_frac))
        if ch.dtype != torch.int64 or tuple(ch.shape) != want:
            raise ValueError(f"channels must be int64 {want} for partial_frac {self.partial_frac}, "
                             f"got {ch.dtype} {tuple(ch.shape)}")
        if ch.numel() and (int(ch.min()) < 0 or int(ch.max()) >= dim or bool((ch.diff(dim=-1) <= 0).any())):
            raise ValueError(f"channels must be distinct, ascending and in [0, {dim})")
        eye = torch.eye(dim, dtype=torch.float32, device=rot.device)
        error = float((rot @ rot.transpose(-1, -2) - eye).abs().max()) if rot.numel() else 0.0
        if not error <= ORTHOGONALITY_TOLERANCE:
            raise ValueError(f"rotations are not orthogonal (max |A Aᵀ - I| = {error:.3g})")


def partial_keys(tables: SkewTables, layer: int, k_rot: torch.Tensor) -> torch.Tensor:
    """The partial key cache rows of ``k_rot`` ``[T, Hkv, D]`` (keys after rotary, any float dtype):
    ``[T, Hkv, R]`` float32, ``(k A)[..., channels]``."""
    proj = _kept_columns(tables, layer).to(k_rot.device)  # [Hkv, D, R]
    return torch.einsum("thd,hdr->thr", k_rot.float(), proj)


def partial_query(tables: SkewTables, layer: int, q_rot: torch.Tensor) -> torch.Tensor:
    """The partial queries of ``q_rot`` ``[T, Hq, D]`` (after rotary, any float dtype): ``[T, Hq, R]``
    float32; query head ``j`` uses KV head ``j // (Hq / Hkv)``'s rotation and channels, so
    ``partial_query(q)[t, j] · partial_keys(k)[s, j // G]`` is the partial score of that pair."""
    proj = _kept_columns(tables, layer).to(q_rot.device)
    group = q_rot.shape[1] // proj.shape[0]
    return torch.einsum("thd,hdr->thr", q_rot.float(), proj.repeat_interleave(group, dim=0))


def _kept_columns(tables: SkewTables, layer: int) -> torch.Tensor:
    """``[Hkv, D, R]``: the columns of layer ``layer``'s rotations that are kept."""
    rot, ch = tables.rotations[layer], tables.channels[layer]
    return torch.gather(rot, 2, ch[:, None, :].expand(-1, rot.shape[1], -1))


def speculation_query(
    model: LlamaForCausalLM, layer: int, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Layer ``layer``'s rotary query from a residual-stream hidden state ``x`` ``[T, hidden]``:
    ``apply_rotary(q_norm(q_proj(input_layernorm(x))))`` (q_norm: Qwen3 only) with layer ``layer``'s norm and
    projection, ``[T, Hq, D]`` in ``x``'s dtype. With ``x`` = layer ``layer``'s own input this is its exact
    query; with an earlier layer's input it is InfiniGen's guess of it. ``cos_sin``:
    `LlamaForCausalLM.rotary` of the tokens' positions, ``[T, D]`` each."""
    attn = model.model.layers[layer].self_attn
    h = model.model.layers[layer].input_layernorm(x)
    q = attn.q_proj(h).reshape(x.shape[0], attn.num_heads, attn.head_dim)
    return apply_rotary(attn.q_norm(q) if attn.qk_norm else q, *cos_sin)


def rotary_key(
    model: LlamaForCausalLM, layer: int, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Layer ``layer``'s rotary key from its input ``x`` ``[T, hidden]``: ``[T, Hkv, D]`` in ``x``'s dtype
    (what the layer writes into the KV pool)."""
    attn = model.model.layers[layer].self_attn
    h = model.model.layers[layer].input_layernorm(x)
    k = attn.k_proj(h).reshape(x.shape[0], attn.num_kv_heads, attn.head_dim)
    return apply_rotary(attn.k_norm(k) if attn.qk_norm else k, *cos_sin)


@torch.inference_mode()
def layer_inputs(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Every decoder layer's input (the residual stream) in one causal forward over ``token_ids`` at
    positions ``0..T-1``: ``[L, T, hidden]`` in the model's dtype, on its device. The forward is the model's
    own, over a scratch one-block KV pool with the reference attention backend.

    Raises:
        ValueError: ``token_ids`` is empty (or as `LlamaForCausalLM.forward` raises).
    """
    if not token_ids:
        raise ValueError("token_ids is empty; calibration needs at least one token")
    config, device = model.config, model.rope_inv_freq.device
    t = len(token_ids)
    dtype = model.model.embed_tokens.weight.dtype
    pool = torch.zeros(1, config.num_hidden_layers, 2, config.num_key_value_heads, t, config.head_dim,
                       dtype=dtype, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    batch = AttentionBatch(
        slot_mapping=torch.arange(t, dtype=torch.int64, device=device), num_prefill_tokens=t,
        prefill_block_tables=torch.zeros(1, 1, **i32), prefill_seq_lens=torch.tensor([t], **i32),
        prefill_query_start_loc=torch.tensor([0, t], **i32),
        decode_block_tables=torch.zeros(0, 1, **i32), decode_seq_lens=torch.zeros(0, **i32))
    inputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda _module, args: inputs.append(args[0]))
             for layer in model.model.layers]
    try:
        model(torch.tensor(token_ids, device=device), torch.arange(t, device=device), pool, batch,
              make_backend("reference"))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(inputs)


@torch.inference_mode()
def compute_skew(loaded: LoadedModel, calib_token_ids: list[int], *, partial_frac: float) -> SkewTables:
    """Skewing rotations and partial channels of every layer from one forward over ``calib_token_ids``
    (see the module doc; a few hundred to a few thousand tokens of ordinary text).

    Raises:
        ValueError: ``partial_frac`` outside ``(0, 1]``; ``calib_token_ids`` empty.
    """
    model, config = loaded.model, loaded.config
    r = num_partial_channels(config.head_dim, partial_frac)
    xs = layer_inputs(model, calib_token_ids)
    positions = torch.arange(len(calib_token_ids), device=xs.device)
    cos_sin = model.rotary(positions, xs.dtype)
    kv_heads, dim = config.num_key_value_heads, config.head_dim
    rotations = torch.empty(config.num_hidden_layers, kv_heads, dim, dim, dtype=torch.float32)
    channels = torch.empty(config.num_hidden_layers, kv_heads, r, dtype=torch.int64)
    for layer, x in enumerate(xs):
        q = speculation_query(model, layer, x, cos_sin).float().cpu()  # [T, Hq, D]
        groups = q.reshape(q.shape[0], kv_heads, -1, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
        for h in range(kv_heads):
            _, _, vh = torch.linalg.svd(groups[h], full_matrices=False)  # groups[h] = U S Vh
            a = vh.T.contiguous()
            rotations[layer, h] = a
            channels[layer, h] = (groups[h] @ a).abs().sum(dim=0).topk(r).indices.sort().values
    tables = SkewTables(rotations=rotations, channels=channels, partial_frac=partial_frac,
                        model_fingerprint=loaded.fingerprint)
    tables.check_integrity()
    return tables


def skew_path(model_dir: str | Path, fingerprint: str, partial_frac: float) -> Path:
    """``<model_dir>/infinigen-skew-<fingerprint[:16]>-r<partial_frac>.safetensors``."""
    return Path(model_dir) / f"infinigen-skew-{fingerprint[:16]}-r{partial_frac:g}.safetensors"


def save_skew(tables: SkewTables, path: str | Path) -> None:
    """Write ``tables`` to ``path`` (safetensors; the fingerprint and fraction in its metadata), atomically."""
    tables.check_integrity()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"rotations": tables.rotations.cpu().contiguous(), "channels": tables.channels.cpu().contiguous()},
              str(tmp), metadata={"format": SKEW_FORMAT, "model_fingerprint": tables.model_fingerprint,
                                  "partial_frac": repr(float(tables.partial_frac))})
    tmp.replace(path)


def load_skew(path: str | Path, *, model_fingerprint: str, partial_frac: float) -> SkewTables | None:
    """The tables at ``path``, or None when there is no such file (compute them: `compute_skew`).

    Raises:
        ValueError: the file was made for other weights (fingerprint), another ``partial_frac``, is not a
            skew file, or fails `SkewTables.check_integrity`: never use it; delete it and compute again.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != SKEW_FORMAT:
                raise ValueError(f"{path} is not a {SKEW_FORMAT} file (format {meta.get('format')!r})")
            if meta.get("model_fingerprint") != model_fingerprint:
                raise ValueError(f"{path} was computed for model {str(meta.get('model_fingerprint'))[:16]}…, not "
                                 f"{model_fingerprint[:16]}…; delete it and compute the skew for this model")
            frac = float(meta.get("partial_frac", "nan"))
            if not math.isclose(frac, partial_frac, rel_tol=0.0, abs_tol=1e-12):
                raise ValueError(f"{path} holds partial_frac {frac}, not {partial_frac}; "
                                 f"use skew_path for this fraction")
            tables = SkewTables(rotations=f.get_tensor("rotations"), channels=f.get_tensor("channels"),
                                partial_frac=partial_frac, model_fingerprint=model_fingerprint)
    except (SafetensorError, KeyError) as e:
        raise ValueError(f"{path} is not a readable skew file ({e}); delete it and compute the skew again") from e
    tables.check_integrity()
    return tables


def calibration_token_ids(loaded: LoadedModel, *, max_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``max_tokens`` ids of `CALIBRATION_TEXT` through the model's tokenizer. A model directory
    without a tokenizer (a test model) gets ``max_tokens`` pseudo-random ids, seeded by its fingerprint:
    a rotation fitted to noise, so the log says that speculation will be weak."""
    tokenizer = load_tokenizer(loaded.model_dir)
    if tokenizer is not None:
        return tokenizer.encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)[:max_tokens]
    log.warning("%s has no tokenizer: calibrating InfiniGen's skew on random tokens (speculation will be weak)",
                loaded.model_dir)
    rng = random.Random(loaded.fingerprint)
    return [rng.randrange(loaded.config.vocab_size) for _ in range(max_tokens)]


def load_or_compute_skew(loaded: LoadedModel, *, partial_frac: float) -> SkewTables:
    """The model's tables for ``partial_frac``: read from `skew_path` next to the weights, else computed on
    `calibration_token_ids` and written there (if the directory is writable; else kept in memory only).

    Raises:
        ValueError: a file at `skew_path` does not belong to these weights or this fraction (`load_skew`).
    """
    path = skew_path(loaded.model_dir, loaded.fingerprint, partial_frac)
    tables = load_skew(path, model_fingerprint=loaded.fingerprint, partial_frac=partial_frac)
    if tables is not None:
        return tables
    start = time.monotonic()
    tables = compute_skew(loaded, calibration_token_ids(loaded), partial_frac=partial_frac)
    try:
        save_skew(tables, path)
    except OSError as exc:
        log.warning("cannot write InfiniGen's skew tables to %s (%s); they live in memory only", path, exc)
    log.info("computed InfiniGen's skew tables (partial_frac %g) in %.1f s: %s", partial_frac,
             time.monotonic() - start, path)
    return tables
