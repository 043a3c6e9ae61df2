"""`LLM`: kvrelay in one process, no network, the way vLLM's offline API reads.

    from kvrelay import LLM, SamplingParams

    llm = LLM(model=".models/smollm2-135m-instruct")
    for out in llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(max_tokens=16)):
        print(out.prompt, out.outputs[0].text)

``model`` is a local directory or a Hugging Face Hub repo id (``LLM("Qwen/Qwen3-0.6B")``, fetched into the hub
cache by `model.hub`). The engine is the one the servers run (`engine.engine.LLMEngine`), sized the same way: KV
memory in bytes (``kv_cache_memory``) or, on CUDA, vLLM's ``gpu_memory_utilization`` (the share of the GPU's total
memory for weights, activations and KV together; `deploy.gpu_memory`), never a block count. Generation with the
same seed gives the same tokens as the server.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.model.generation_config import load_generation_defaults
from kvrelay.model.sampling_params import PromptTokenLogprobs, TokenLogprobs
from kvrelay.sampling_params import SamplingParams

Prompt = str | Sequence[int]
log = logging.getLogger(__name__)
CPU_KV_CACHE_MEMORY = "1GiB"  # the device tier on a CPU device when kv_cache_memory is not given
CUDA_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, on CUDA when neither is given


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One sample: its text, token ids, per-token logprobs (when asked for) and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One prompt's result: ``outputs`` holds ``n`` samples, by index. ``prompt_logprobs`` (vLLM's), when the params
    asked for them: None for the first prompt token, then each later one's `PromptTokenLogprobs` (computed in full,
    never from the prefix cache: `engine.prompt_logprobs`)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None


class LLM:
    """A model and its engine in this process.

    Args:
        model: a Hugging Face model directory (`kvrelay model pull`, `kvrelay tiny-model`), or a Hugging Face
            Hub repo id ``ORG/NAME`` that is not a local path (fetched into the hub cache; ``HF_HOME``,
            ``HF_TOKEN``, ``HF_HUB_OFFLINE`` apply).
        revision, download_dir: of a hub repo id: the branch, tag or commit (default ``main``) and the hub
            cache (default ``huggingface_hub``'s), as vLLM's.
        dtype: ``auto`` (bfloat16 on CUDA and on CPUs with AMX / AVX512-BF16, else float32), ``float32``,
            ``bfloat16``, ``float16``.
        device: ``auto`` (CUDA when this process sees a GPU, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        block_size: tokens per KV block.
        kv_cache_memory: KV bytes on the device (an int, or a size such as ``"2GiB"``); default
            `CPU_KV_CACHE_MEMORY` on a CPU device.
        gpu_memory_utilization: on CUDA, vLLM's meaning: the share of the GPU's total memory for the weights,
            activations and KV together; default `CUDA_GPU_MEMORY_UTILIZATION` on CUDA. Ignored on a CPU device
            (logged; the KV takes ``kv_cache_memory``'s default), as vLLM's CPU build ignores it.
        max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching: as the server's
            ``engine`` section.
        generation_config: ``auto`` (the model's ``generation_config.json`` gives the defaults of
            `get_default_sampling_params`, as vLLM's) or ``vllm`` (vLLM's neutral defaults).

    Raises:
        deploy.sizes.ConfigError: a bad value, naming it (as the server's config does).
        model.hub.HubError: a repo id that cannot be fetched, naming it and what to do.
    """

    def __init__(self, model: str | Path, *, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 kv_cache_memory: int | str | None = None, gpu_memory_utilization: float | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, generation_config: str = "auto", revision: str | None = None,
                 download_dir: str | Path | None = None) -> None:
        from prometheus_client import CollectorRegistry

        from kvrelay.deploy.config import parse_config
        from kvrelay.deploy.serve import build_engine
        from kvrelay.deploy.sizes import ConfigError
        from kvrelay.model.device import resolve_device
        from kvrelay.model.hub import resolve_model
        from kvrelay.model.tokenizer import load_tokenizer

        if kv_cache_memory is not None and gpu_memory_utilization is not None:
            raise ConfigError("give kv_cache_memory or gpu_memory_utilization, not both")
        try:
            device = resolve_device(device)
        except ValueError as exc:
            raise ConfigError(f"device {device!r} {exc}") from None
        if not device.startswith("cuda") and gpu_memory_utilization is not None:
            log.warning("gpu_memory_utilization=%g is ignored on %s (it is a share of a GPU's memory, as vLLM's is); "
                        "the KV takes %s: pass kv_cache_memory to size it", gpu_memory_utilization, device,
                        CPU_KV_CACHE_MEMORY)
            gpu_memory_utilization = None
        if kv_cache_memory is None and gpu_memory_utilization is None:
            if device.startswith("cuda"):
                gpu_memory_utilization = CUDA_GPU_MEMORY_UTILIZATION
            else:
                kv_cache_memory = CPU_KV_CACHE_MEMORY
        kv_device: dict[str, Any] = ({"gpu_memory_utilization": gpu_memory_utilization}
                                     if gpu_memory_utilization is not None else {"bytes": kv_cache_memory})
        source = resolve_model(model, revision=revision, download_dir=download_dir)
        engine = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                  "enable_prefix_caching": enable_prefix_caching}
        if max_model_len is not None:
            engine["max_model_len"] = max_model_len
        self.config = parse_config({
            "model": {"path": str(source.path), "name": source.repo_id, "dtype": dtype, "device": device},
            "kvstore": {"block_size_tokens": block_size, "device": kv_device},
            "engine": engine,
        }, base_dir=Path.cwd())
        self.engine = build_engine(self.config, node_name="offline", registry=CollectorRegistry())
        self.tokenizer = load_tokenizer(self.config.model.path)
        self._defaults = load_generation_defaults(self.config.model.path, generation_config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no params (vLLM's): `SamplingParams()` with the model's
        generation_config.json defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens
        as max_tokens) under ``generation_config="auto"``."""
        d = self._defaults
        return SamplingParams(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, min_p=d.min_p,
                              repetition_penalty=d.repetition_penalty, max_tokens=d.max_tokens or 16)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids) in one batch; results in prompt order.

        ``sampling_params``: one for all, or one per prompt (default: `get_default_sampling_params`, which
        samples at temperature 1.0 unless the model's generation_config.json says otherwise, as vLLM's). A
        request's seed gives the same tokens as the server with that seed.

        Raises:
            engine.engine.RequestError: a prompt the engine refuses (empty, too long, ...), naming it.
            ValueError: as many params as prompts were not given.
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        params_list = (list(sampling_params) if isinstance(sampling_params, Sequence)
                       else [sampling_params or self.get_default_sampling_params()] * len(prompt_list))
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt_list]
        return self._run(prompt_list, token_lists, params_list, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Chat completions: each conversation (a list of ``{"role", "content"}``, or a list of them)
        rendered with the model's chat template, then generated as `generate` does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer.chat_template is None:
            raise ValueError(f"{self.config.model.path} has no chat template; use generate()")
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        token_lists = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        params_list = (list(sampling_params) if isinstance(sampling_params, Sequence)
                       else [sampling_params or self.get_default_sampling_params()] * len(texts))
        return self._run(texts, token_lists, params_list, use_tqdm)

    def _run(self, prompts: list[Any], token_lists: list[list[int]], params_list: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        ids = [f"llm-{next(self._ids)}" for _ in token_lists]
        tokens: dict[str, list[list[int]]] = {}
        logprobs: dict[str, list[list[TokenLogprobs]]] = {}
        reasons: dict[str, list[str | None]] = {}
        prompt_logprobs: dict[str, list[PromptTokenLogprobs]] = {}
        added: list[str] = []
        try:
            for rid, ids_, p in zip(ids, token_lists, params_list, strict=True):
                self.engine.add_request(rid, ids_, p)
                added.append(rid)
                tokens[rid] = [[] for _ in range(p.n)]
                logprobs[rid] = [[] for _ in range(p.n)]
                reasons[rid] = [None] * p.n
            with tqdm(total=len(ids), desc="generating", unit="prompt", disable=not use_tqdm) as bar:
                unfinished = {rid: p.n for rid, p in zip(ids, params_list, strict=True)}
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.request_id not in unfinished:
                            continue
                        tokens[out.request_id][out.index].extend(out.new_token_ids)
                        logprobs[out.request_id][out.index].extend(out.logprobs or ())
                        if out.prompt_logprobs is not None:
                            prompt_logprobs[out.request_id] = out.prompt_logprobs
                        if out.finished:
                            reasons[out.request_id][out.index] = out.finish_reason
                            unfinished[out.request_id] -= 1
                            if unfinished[out.request_id] == 0:
                                bar.update(1)
        finally:
            for rid in added:
                if self.engine.is_active(rid):
                    self.engine.abort_request(rid)
        results = []
        for rid, prompt, ids_, p in zip(ids, prompts, token_lists, params_list, strict=True):
            outputs = [CompletionOutput(i, self.tokenizer.decode(tokens[rid][i]), tokens[rid][i], reasons[rid][i],
                                        logprobs[rid][i] if p.logprobs is not None else None) for i in range(p.n)]
            prompt_lps = prompt_logprobs.get(rid)
            results.append(RequestOutput(prompt if isinstance(prompt, str) else None, ids_, outputs,
                                         None if prompt_lps is None else [None, *prompt_lps]))
        return results

    def close(self) -> None:
        """Close the engine (commits queued disk writes)."""
        self.engine.close()


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
