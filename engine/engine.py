"""`LLMEngine`: one process, paged KV, prefix cache, continuous batching.

Used directly by ``kvrelay generate`` and as the compute core of the prefill and decode services.

    engine = LLMEngine(load_model(dir), EngineConfig(num_blocks=512))
    engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from kvrelay.engine.block_tables import BlockTables, held
from kvrelay.engine.cuda_graphs import try_capture
from kvrelay.engine.engine_config import EngineConfig
from kvrelay.engine.grammar import GrammarError, Grammars, apply_masks, lift_min_tokens
from kvrelay.engine.kernel_tuning import deterministic_plan_for, plan_for
from kvrelay.engine.kv_layout import kv_block_spec
from kvrelay.engine.kv_policy import KvPolicies
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.prompt_logprobs import wants_prompt_logprobs
from kvrelay.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.engine.step_rates import StepRates
from kvrelay.engine.token_histogram import TokenHistogram
from kvrelay.kvstore.block_key import BlockKey, extend_group_keys
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig
from kvrelay.model.attention import AttentionBackend, TorchBackend, default_backend_name, make_backend
from kvrelay.model.kernel_paths import apply_kernel_plan
from kvrelay.model.kernel_plan import KernelPlan
from kvrelay.model.llama import LlamaForCausalLM
from kvrelay.model.loader import LoadedModel
from kvrelay.model.sampling import SamplingParams, TokenLogprobs, sample, token_generator
from kvrelay.model.sampling_params import MAX_LOGPROBS, PromptTokenLogprobs
from kvrelay.model.skew import SkewTables, load_or_compute_skew
from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)
MAX_KV_RECOMPUTES = 2  # recomputes after failed integrity checks before a sequence stops offloading


class RequestError(ValueError):
    """A request the engine refuses; the message names the problem (maps to HTTP 400)."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """New tokens of one sample after one step. ``finish_reason``: ``stop`` | ``length`` | ``abort``."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens this sample reused from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for them
    # the prompt's logprobs, positions 1 to P - 1 (`engine.prompt_logprobs`): on sample 0's first token, when the
    # request asked for them and its prompt was prefilled here
    prompt_logprobs: list[PromptTokenLogprobs] | None = None


@dataclass(slots=True)
class EngineStats:
    """Counters since start (tokens)."""

    computed_prefill_tokens: int = 0
    generated_tokens: int = 0
    # of the requests whose first token this engine computes (once per request, whatever n); a request that
    # arrives with its first tokens (KV from a prefill node, a migration) was counted where they were computed
    prompt_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    step_tokens: TokenHistogram = field(default_factory=TokenHistogram)  # tokens computed per step


@dataclass(slots=True)
class _Request:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)


class LLMEngine:
    """Continuous-batching engine over a paged KV pool with a prefix cache.

    Args:
        loaded: the model (`model.loader.load_model`).
        config: sizing.
        spec: the KV block layout, when the caller built it already (a deployment builds it once from
            its ``kvstore`` section and sizes the tiers with it); then ``config.block_size_tokens`` and
            ``config.kv_dtype`` are not used. Default: `block_spec_for` from ``config``.

    Raises:
        ValueError: ``spec`` does not describe ``loaded``'s KV (layers, heads, head size, weights).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        spec: BlockSpec | None = None,
        store_config: TieredStoreConfig | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        cfg = loaded.config
        self.model_config = cfg
        self.model = loaded.model
        self._loaded = loaded
        device = next(self.model.parameters()).device
        if spec is None:
            spec = self.block_spec_for(loaded, self.config.block_size_tokens, kv_dtype=self.config.kv_dtype)
        elif (spec.num_layers * spec.num_groups, spec.num_groups, spec.num_planes, spec.num_kv_heads, spec.head_dim,
              spec.model_fingerprint) != (cfg.num_hidden_layers, len(cfg.kv_groups), *cfg.kv_planes,
                                          loaded.fingerprint):
            groups = f" × {spec.num_groups} groups" if spec.num_groups > 1 else ""
            raise ValueError(f"the block spec ({spec.num_layers} layers{groups}, {spec.num_planes} planes of "
                             f"{spec.num_kv_heads} heads of {spec.head_dim}, model {spec.model_fingerprint[:12]}) is "
                             f"not this model's")
        self.spec = spec
        self.max_model_len = self.config.max_model_len or cfg.max_context_tokens
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.grammars = Grammars(loaded.model_dir, cfg.vocab_size, sorted(self.eos_token_ids),
                                 compile_timeout_s=self.config.grammar_compile_timeout_s)
        if store_config is None:
            store_config = TieredStoreConfig(num_device_blocks=self.config.num_blocks, device=str(device))
        self.store = TieredStore(self.spec, store_config, registry=registry)
        self.pool = self.store.block_pool
        self.kv_pool = self.store.device_pool
        self.attention_backend = self.config.attention_backend or default_backend_name(device)  # the one in use
        backend = make_backend(self.attention_backend)
        self.kernel_plan = self._plan_kernels(backend)
        self.runner = ModelRunner(self.model, self.kv_pool, backend, block_size_tokens=self.spec.block_size_tokens,
                                  num_groups=self.spec.num_groups,
                                  gives_back_blocks=any(g.window is not None for g in cfg.kv_groups))
        if self.spec.num_groups > 1:
            log.info("CUDA graphs are off for a model with %d KV block groups (graph inputs hold one block table "
                     "per sequence)", self.spec.num_groups)
        elif self.config.cuda_graphs and device.type == "cuda" and getattr(backend, "supports_cuda_graphs", False):
            self.runner.graphs = try_capture(self.model, self.kv_pool, backend, sizes=self.config.graph_batch_sizes,
                                             max_model_len=self.max_model_len)
        tables = BlockTables(self.store.block_pool)  # the one writer of block tables, shared below
        self.policies = KvPolicies(self.store, backend, tables=tables, spec=self.spec, scale=cfg.head_dim**-0.5)
        self.check_long_context(self.config.long_context)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                enable_prefix_caching=self.config.enable_prefix_caching,
                prefill_packing=self.config.prefill_packing,
            ),
            self.store, tables=tables, spec=self.spec, copy_block=self.runner.copy_block,
            on_free=self.policies.on_free, group_windows=tuple(g.window for g in cfg.kv_groups),
        )
        self.stats = EngineStats()
        self.rates = StepRates()
        self.scheduler.step_cost = lambda: self.rates.cost.coefficients
        self._requests: dict[str, _Request] = {}
        self._next_seq_id = 0
        self._device = device
        self._seed_rng = random.Random()
        self._pending_outputs: list[StepOutput] = []
        # Set by a step that could schedule nothing because blocks held outside the scheduler (leases,
        # pulls) keep the pending work from fitting: the caller may wait for a pool change before stepping.
        self.stalled = False

    def _plan_kernels(self, backend: AttentionBackend) -> KernelPlan:
        """The model's kernel plan (`engine.kernel_tuning.plan_for` with ``config.kernel_plan``, or
        `engine.kernel_tuning.deterministic_plan_for` with ``config.deterministic``), applied to the
        model (once: a model another engine planned keeps its plan) and followed by ``backend``; logged."""
        plan = getattr(self.model, "kernel_plan", None)
        if plan is not None and plan.deterministic != self.config.deterministic:
            raise ValueError(f"engine.deterministic is {self.config.deterministic}, but this model was planned for "
                             f"another engine with deterministic {plan.deterministic}; load the model again")
        if plan is None:
            plan = (deterministic_plan_for(self.model, self.kv_pool, backend) if self.config.deterministic
                    else plan_for(self.model, self.kv_pool, backend, mode=self.config.kernel_plan))
            if isinstance(self.model, LlamaForCausalLM):
                apply_kernel_plan(self.model, plan)
            log.info("kernel plan (%s): %s", plan.source, plan.summary())
        if isinstance(backend, TorchBackend):
            backend.follow(plan)
        return plan

    @property
    def cuda_graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes captured in CUDA graphs (none off CUDA, or when capture failed)."""
        graphs = self.runner.graphs
        return graphs.sizes if graphs is not None and graphs.capture else ()

    @staticmethod
    def block_spec_for(loaded: LoadedModel, block_size_tokens: int, *, kv_dtype: str | None = None) -> BlockSpec:
        """The KV block layout of ``loaded``; its KV dtype is ``kv_dtype``, by default its parameters' dtype."""
        dtype = kv_dtype or str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        return kv_block_spec(loaded.config, fingerprint=loaded.fingerprint, block_size_tokens=block_size_tokens,
                             dtype=dtype)

    def prompt_block_keys(self, prompt_token_ids: Seq[int], salt: bytes) -> list[BlockKey]:
        """The keys of the full blocks of a prompt under this engine's `BlockSpec`: one per 16-token block,
        or, with G block groups, G per 16-token block (`kvstore.block_key.extend_group_keys`). A pure
        function: safe to call from any thread. Raises ValueError for a token id outside ``[0, 2**32)``."""
        return extend_group_keys([], prompt_token_ids, num_groups=self.spec.num_groups,
                                 block_size_tokens=self.spec.block_size_tokens,
                                 spec_fingerprint=self.spec.fingerprint, salt=salt)

    # ------------------------------------------------------------------ inputs
    def validate_prompt(self, prompt_token_ids: Seq[int]) -> None:
        """Raises RequestError for an empty prompt, an id outside the vocabulary or a prompt too long."""
        vocab = self.model_config.vocab_size
        if len(prompt_token_ids) == 0:
            raise RequestError("prompt is empty; send at least one token")
        for pos, tok in enumerate(prompt_token_ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise RequestError(f"token id {tok!r} at position {pos} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_token_ids)} tokens but the context window is {self.max_model_len} "
                f"tokens (including at least one generated token)"
            )
        needed = -(-(len(prompt_token_ids) + 1) // self.spec.block_size_tokens) * self.spec.num_groups
        if needed > self.pool.num_blocks:
            raise RequestError(
                f"prompt needs {needed} KV blocks but the pool holds {self.pool.num_blocks}; shorten the prompt"
            )

    def check_long_context(self, config: LongContextConfig) -> None:
        """Raises ValueError when this engine cannot run ``config`` (budget too small, no host tier, or a model
        the policies cannot serve: `ModelConfig.long_context_refusal`)."""
        config.check(self.spec.block_size_tokens)
        refusal = self.model_config.long_context_refusal
        if config.active and refusal is not None:
            raise ValueError(f"long_context: policy {config.policy} is not supported for {refusal}; use policy none")
        if config.active and self.config.deterministic:
            raise ValueError(f"long_context: policy {config.policy} selects KV by attention scores through kernels "
                             "deterministic mode does not cover (engine.deterministic); use policy none")
        if config.policy == "infinigen" and self.store.host is None:
            raise ValueError("long_context: infinigen offloads to the host tier, and this node has none; "
                             "size kvstore.host.bytes or use policy h2o")
        if config.speculative and self.policies.speculative.speculation is None:
            frac = self.config.long_context.partial_channels_frac  # the deployment's: requests cannot set it
            self.use_skew(load_or_compute_skew(self._loaded, partial_frac=frac))

    def use_skew(self, tables: SkewTables) -> None:
        """Speculate with ``tables`` (InfiniGen's skew of this model; `model.skew`). Computed on first need
        from the calibration text; benchmarks and tests may fit their own first.

        Raises:
            ValueError: the tables were made for other weights or do not fit the model's shapes.
        """
        self.policies.speculative.use_skew(self.model, self.spec.model_fingerprint, tables)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        salt: bytes = b"",
        first_token_ids: Seq[int] | None = None,
        resume_token_ids: Seq[Seq[int] | None] | None = None,
        pinned_block_ids: Seq[int] = (),
        long_context: LongContextConfig | None = None,
        block_keys: Seq[BlockKey] | None = None,
    ) -> None:
        """Queue a request. Its ``params.n`` samples share the prompt's blocks after prefill.

        Args:
            first_token_ids: one first token per sample, already sampled elsewhere (the prefill
                service); each sample then continues from ``prompt + [first]``. A sample that its
                first token already finishes is reported by the next `step`.
            resume_token_ids: instead of ``first_token_ids``, a request that moved here mid-stream (its decode
                node died): per sample, every token it generated so far (it continues from ``prompt +
                tokens``, their KV recomputed here, sampling at the same output positions; none yet: an
                empty list), or None for a sample that had already finished (the next `step` reports it
                finished, with reason ``"resumed"``, and it never runs).
            pinned_block_ids: blocks the caller holds a reference on (KV pulled from a peer, keyed
                in this pool). The engine takes over those references and drops them once the
                request's last sample has been admitted (its prefix match has acquired them) or ends.
            long_context: this request's policy (default: ``config.long_context``).
            block_keys: the keys of the prompt's full blocks (`prompt_block_keys`), when the caller has
                computed them already (the node computes them once per request, at its edge); else the
                scheduler computes them.

        Raises:
            RequestError: invalid prompt, first or resumed tokens, or a duplicate ``request_id``.
            ValueError: ``block_keys`` does not hold one key per full prompt block.
        """
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already running")
        self.validate_prompt(prompt_token_ids)
        if params.prompt_logprobs == -1 and self.model_config.vocab_size > MAX_LOGPROBS:
            raise RequestError(f"prompt_logprobs -1 asks for the whole vocabulary ({self.model_config.vocab_size} "
                               f"tokens) at each prompt position; the most is {MAX_LOGPROBS}")
        policy = long_context or self.config.long_context
        try:
            self.check_long_context(policy)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        prompt = list(prompt_token_ids)
        full_blocks = len(prompt) // self.spec.block_size_tokens
        if block_keys is not None and len(block_keys) != full_blocks * self.spec.num_groups:
            groups = f" × {self.spec.num_groups} block groups" if self.spec.num_groups > 1 else ""
            raise ValueError(f"{len(block_keys)} block keys for a prompt of {len(prompt)} tokens "
                             f"({full_blocks} full blocks{groups})")
        req = _Request(request_id, params)
        outputs = _given_outputs(first_token_ids, resume_token_ids, params.n)
        done_elsewhere: list[int] = []
        if outputs is None:
            req.seqs.append(self._new_sequence(request_id, 0, prompt, len(prompt), params, salt))
        else:
            for index, toks in enumerate(outputs):
                if toks is None:
                    done_elsewhere.append(index)
                    continue
                self.validate_prompt(prompt + toks)
                seq = self._new_sequence(request_id, index, prompt + toks, len(prompt), params, salt)
                seq.forked = True
                req.seqs.append(seq)
        if params.structured_outputs is not None:
            try:  # compiled before (the nodes and LLM do it off this thread): a cache hit
                for seq in req.seqs:
                    seq.matcher = self.grammars.matcher(params.structured_outputs, seq.output_token_ids)
            except GrammarError as exc:
                raise RequestError(str(exc)) from None
        if block_keys is not None:
            for seq in req.seqs:
                seq.block_keys = list(block_keys)  # the prompt's full blocks are the same in prompt + outputs
        self._requests[request_id] = req
        if outputs is None:
            self.stats.prompt_tokens += len(prompt)
        req.seqs[-1].pinned_block_ids = list(pinned_block_ids)
        self._pending_outputs.extend(StepOutput(request_id, i, [], True, "resumed") for i in done_elsewhere)
        for seq in req.seqs:
            seq.long_context = policy if policy.active else None
            self.scheduler.add(seq)
            if seq.num_output_tokens > 0:  # arrived with output tokens: the last may already end it
                reason = self._finish_reason(seq, seq.token_ids[-1])
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    self._pending_outputs.append(StepOutput(request_id, seq.index, [], True, reason))
        self._forget_if_done(request_id)

    def _new_sequence(
        self, request_id: str, index: int, token_ids: list[int], num_prompt: int, params: SamplingParams, salt: bytes
    ) -> Sequence:
        seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**63)
        seq = Sequence(
            seq_id=self._next_seq_id, request_id=request_id, index=index, arrival=self._next_seq_id,
            token_ids=token_ids, num_prompt_tokens=num_prompt, params=params, salt=salt,
            seed=seed,
        )
        self._next_seq_id += 1
        return seq

    def abort_request(self, request_id: str) -> list[StepOutput]:
        """Stop every sample of a request now and release its blocks. Unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return []
        outs = []
        for seq in req.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
                outs.append(StepOutput(request_id, seq.index, [], True, "abort"))
        if len(req.seqs) == 1 and not req.seqs[0].forked:  # aborted before its n samples were split off
            outs.extend(StepOutput(request_id, i, [], True, "abort") for i in range(1, req.params.n))
        return outs

    def is_active(self, request_id: str) -> bool:
        """True while any sample of the request is waiting or running."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    # -------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        """Run one scheduled model step; return the new tokens of every sample that got one (not those whose
        KV failed an integrity check during the step: `_drop_corrupt`).

        Raises:
            Exception: whatever failed mid-step. The outputs it had made (earlier finishes, tokens already
                appended) are returned by the next step; what else it leaves is `engine.step_isolation`'s
                to mend."""
        outputs, self._pending_outputs = self._pending_outputs, []
        try:
            self._step_into(outputs)
        except BaseException:
            self._pending_outputs[:0] = outputs
            raise
        return outputs

    def _step_into(self, outputs: list[StepOutput]) -> None:
        """`step`'s work, its outputs appended to ``outputs``."""
        self.stalled = False
        sched: ScheduledStep = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        for seq in sched.preempted:
            log.info("preempted %s (sample %d, %d tokens): the KV pool is full; it will be recomputed",
                     seq.request_id, seq.index, len(seq.token_ids))
        if sched.empty:
            if self.scheduler.running or self.scheduler.waiting:
                outputs.extend(self._unstick())
            return
        t0 = time.perf_counter()
        try:
            result = self.runner.run(sched, kv_hook=self.policies.step_hook(sched))
        finally:  # no prefetch outlives the forward, even one that raised (its requests' blocks are given back)
            self.policies.speculative.end_step()
        self.stats.steps += 1
        self.stats.step_tokens.observe(sum(chunk.num_tokens for chunk in sched.prefills) + len(sched.decodes))
        for part in result.prompt_logprobs:  # a recomputed prompt (preempted mid-prefill) overwrites its entries
            del part.seq.prompt_logprobs[part.first_position - 1 :]
            part.seq.prompt_logprobs.extend(part.entries)
        for chunk in sched.prefills:
            self.stats.computed_prefill_tokens += chunk.num_tokens
            self.scheduler.commit(chunk.seq, chunk.num_tokens)
        for seq in sched.decodes:
            self.scheduler.commit(seq, 1)
        pairs = self._drop_corrupt(self._expand_forks(result.seqs))
        rows = [row for _, row in pairs]
        gens = [None if s.params.greedy else
                token_generator(s.seed, s.index, s.num_output_tokens, self._device) for s, _ in pairs]
        histories = [(s.token_ids[:s.num_prompt_tokens], s.output_token_ids) if s.params.adjusts_logits else None
                     for s, _ in pairs]
        logits, argmax = result.logits, result.greedy  # each row once, in order (no fork, nothing dropped): no gather
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device))
            argmax = None if argmax is None else [argmax[r] for r in rows]
        params = [s.params for s, _ in pairs]
        matchers = [s.matcher for s, _ in pairs]
        if any(m is not None for m in matchers):
            logits, argmax = logits.float(), None  # the masks move the maxima
            apply_masks(logits, matchers)
            params = [p if s.matcher is None else lift_min_tokens(p, logits[i], s.num_output_tokens,
                                                                  self.eos_token_ids)
                      for i, ((s, _), p) in enumerate(zip(pairs, params, strict=True))]
        tokens, logprobs = sample(logits, params, gens, histories, self.eos_token_ids, argmax)
        for (seq, _), tok, lp in zip(pairs, tokens, logprobs, strict=True):
            if seq.matcher is not None and not seq.matcher.accept(tok):
                log.error("%s (sample %d): token %d is outside its grammar; ending it", seq.request_id, seq.index,
                          tok)
                seq.matcher = None
                self.scheduler.finish(seq, "stop")
                outputs.append(StepOutput(seq.request_id, seq.index, [], True, "stop", seq.num_cached_prompt_tokens))
                continue
            outputs.append(self._append_token(seq, tok, lp))
        self.rates.observe(prefill_tokens=sum(c.num_tokens for c in sched.prefills), decode_seqs=len(sched.decodes),
                           seconds=time.perf_counter() - t0)
        if self.rates.prefill_tokens_per_s > 0:  # what recomputing a cached block costs (`kvstore.fetch_cost`)
            self.store.fetch_costs.recompute_s = self.spec.block_size_tokens / self.rates.prefill_tokens_per_s
        for req_id in {o.request_id for o in outputs if o.finished}:
            self._forget_if_done(req_id)
        self.policies.after_step(self.scheduler.running)
        self.store.maintain_watermark()

    def _unstick(self) -> list[StepOutput]:
        """Nothing could be scheduled although requests are pending: free blocks so the next step can.

        In order: preempt the newest running sequence if another could use its blocks; let waiting
        sequences drop the blocks they hold for later (pins, prefix matches) so the first can start;
        wait (`stalled`) while blocks held outside the scheduler (leases, pulls) keep the one sequence
        left from fitting; finally end the one sequence that alone needs more blocks than the pool has
        (``length``). Never fails the other requests.
        """
        sch = self.scheduler
        if sch.running and (sch.waiting or len(sch.running) > 1):
            victim = sch.running[-1]
            log.info("preempted %s (sample %d, %d tokens) so that waiting work can start", victim.request_id,
                     victim.index, len(victim.token_ids))
            sch.preempt(victim)
            self.stats.preemptions += 1
            return []
        if not sch.running and sch.release_waiting_holds():
            return []
        seq = sch.running[0] if sch.running else sch.waiting[0]
        if sch.fits_once_outside_blocks_return(seq):
            self.stalled = True
            return []
        sch.finish(seq, "length")
        self._forget_if_done(seq.request_id)
        return [StepOutput(seq.request_id, seq.index, [], True, "length", seq.num_cached_prompt_tokens)]

    def _drop_corrupt(self, pairs: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The pairs whose sequence may sample. A sequence a policy flagged during the step
        (``kv_corrupt``: its attention read KV that failed a digest) samples nothing — its logits row is
        skipped, so no token is streamed or appended — and is preempted: its blocks and host slots are
        released (`Scheduler.preempt`, which drops its policy state through ``on_free``) and its KV is
        recomputed from its tokens when it is readmitted. Only decode rows are flagged, and those
        never fork in the step, so every flagged sequence is in ``pairs``. A sequence flagged a second
        time (the host copy keeps going bad) is recomputed without its long-context policy, with full
        attention on device, instead of looping."""
        kept = []
        for seq, row in pairs:
            if not seq.kv_corrupt:
                kept.append((seq, row))
                continue
            seq.kv_corrupt = False
            seq.kv_recomputes += 1
            log.warning("dropped the step's token of %s (sample %d): its KV failed an integrity check; "
                        "recomputing its %d tokens", seq.request_id, seq.index, len(seq.token_ids))
            self.scheduler.preempt(seq)  # frees its policy state (on_free) while it still has a policy
            if seq.kv_recomputes >= MAX_KV_RECOMPUTES and seq.long_context is not None:
                log.error("%s (sample %d) failed %d integrity checks of offloaded KV; it continues with full "
                          "attention on device", seq.request_id, seq.index, seq.kv_recomputes)
                seq.long_context = None
            self.stats.preemptions += 1
        return kept

    def _expand_forks(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Pair each sampling sequence with its logits row; split ``n > 1`` requests at their first token.

        The forked samples share every prompt block (ref counts), the partial tail included; the
        scheduler copies a shared tail before a sample writes into it.
        """
        out: list[tuple[Sequence, int]] = []
        for row, seq in enumerate(seqs):
            out.append((seq, row))
            if seq.params.n > 1 and not seq.forked:
                seq.forked = True
                req = self._requests[seq.request_id]
                for index in range(1, seq.params.n):
                    child = self._new_sequence(
                        seq.request_id, index, list(seq.token_ids), seq.num_prompt_tokens, seq.params, seq.salt
                    )
                    child.forked = True
                    child.seed = seq.seed
                    self.scheduler.tables.fork(seq, child)
                    child.block_keys = list(seq.block_keys)
                    child.num_computed_tokens = seq.num_computed_tokens
                    child.num_keyed_blocks = seq.num_keyed_blocks
                    child.cold_from = seq.cold_from
                    child.tail_scored = seq.tail_scored
                    child.long_context = seq.long_context
                    child.num_absent_tokens = seq.num_absent_tokens
                    child.keys_stopped = seq.keys_stopped
                    child.matcher = None if seq.matcher is None else seq.matcher.fork()
                    self.policies.fork(seq, child)
                    self.scheduler.add_running(child)
                    req.seqs.append(child)
                    out.append((child, row))
        return out

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        """Why ``seq`` stops after ``tok`` (already appended), or None."""
        p = seq.params
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.terminated:  # the grammar ended (ignore_eos or not)
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _append_token(self, seq: Sequence, tok: int, logprobs: TokenLogprobs | None = None) -> StepOutput:
        prompt = None
        if seq.index == 0 and wants_prompt_logprobs(seq):  # its first token: the prompt's logprobs go with it
            prompt, seq.prompt_logprobs = seq.prompt_logprobs, []
        seq.token_ids.append(tok)
        self.stats.generated_tokens += 1
        reason = self._finish_reason(seq, tok)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return StepOutput(seq.request_id, seq.index, [tok], reason is not None, reason, seq.num_cached_prompt_tokens,
                          None if logprobs is None else [logprobs], prompt)

    def _forget_if_done(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and all(s.status is SequenceStatus.FINISHED for s in req.seqs):
            del self._requests[request_id]

    # -------------------------------------------------------------- helpers
    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams], *, salt: bytes = b""
    ) -> list[list[list[int]]]:
        """Run prompts to completion; returns ``[prompt][sample index] -> output token ids``."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        base = self._next_seq_id
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        results: dict[str, list[list[int]]] = {rid: [[] for _ in range(p.n)] for rid, p in zip(ids, plist)}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p, salt=salt)
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id][out.index].extend(out.new_token_ids)
        return [results[rid] for rid in ids]

    def close(self) -> None:
        """Commit queued disk writes and close the store; the engine is unusable afterwards."""
        self.policies.close()
        self.store.close()

    def check_integrity(self) -> None:
        """Every tier's integrity plus: the blocks referenced by live sequences match the ref counts."""
        self.store.check_integrity()
        expected = [0] * self.pool.num_blocks
        for req in self._requests.values():
            for seq in req.seqs:
                if seq.status is not SequenceStatus.FINISHED:
                    for b in held(seq.block_table) + seq.pinned_block_ids:
                        expected[b] += 1
        for b, n in enumerate(expected):
            assert self.pool.ref_count(b) == n, f"block {b}: ref count {self.pool.ref_count(b)}, sequences hold {n}"
        self.policies.check_integrity([s for req in self._requests.values() for s in req.seqs
                                       if s.status is not SequenceStatus.FINISHED])


def _given_outputs(first_token_ids: Seq[int] | None, resume_token_ids: Seq[Seq[int] | None] | None,
                   n: int) -> list[list[int] | None] | None:
    """Per sample, the output tokens a request arrives with (`LLMEngine.add_request`); None: none.

    Raises:
        RequestError: both given, not one entry per sample, or every sample already finished.
    """
    if first_token_ids is not None and resume_token_ids is not None:
        raise RequestError("a request gives either first tokens or resumed tokens, not both")
    if first_token_ids is not None:
        if len(first_token_ids) != n:
            raise RequestError(f"got {len(first_token_ids)} first tokens for n={n} samples")
        return [[int(t)] for t in first_token_ids]
    if resume_token_ids is None:
        return None
    if len(resume_token_ids) != n:
        raise RequestError(f"got resumed tokens for {len(resume_token_ids)} samples, n={n}")
    if all(toks is None for toks in resume_token_ids):
        raise RequestError("a resumed request has no unfinished sample")
    return [None if toks is None else list(toks) for toks in resume_token_ids]
