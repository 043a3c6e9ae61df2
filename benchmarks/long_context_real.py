"""Long-context KV policies on a real model (SmolLM2-135M-Instruct): passkey retrieval and perplexity.

Run by ``kvrelay bench long-context --model real`` (`benchmarks.long_context_bench`). Both measurements run
full attention (``none``) and each policy of `POLICIES` at device budgets that are fractions of the prompt
(`budget_blocks`), through the serving engine with a host tier and the node's NIXL agent:

* **passkey** (the test of Landmark Attention and LongLLaMA) — a random 5-digit number, stated in one
  sentence at a chosen depth of a haystack of repeated filler sentences and asked for at the end, inside
  the model's chat template; the assistant's reply is begun in the prompt (`ANSWER_PREFIX`), the engine
  decodes a few tokens greedily and `parse_passkey` reads the first number. ``accuracy``: replies naming the
  passkey; ``agreement``: replies naming the number full attention's reply names.
* **perplexity** — a fixed public-domain text (`TEXT_PATH`, source in its folder's README) is prefilled up to
  ``prefill_tokens``, then fed one token per decode step: the engine's sampled token is replaced by the
  text's next token before the step that computes its KV (teacher forcing), so the policy evicts, offloads
  and recalls as it does while generating. Each scored token's NLL comes from the logits of the step before
  it (the prefill's last for the first).

Prompt layout, in token ids, built piece by piece so that its length and the needle's place are exact::

    [ chat head + INTRO | filler ... | NEEDLE | filler ... | QUESTION + chat tail + ANSWER_PREFIX ]
    0                   head         needle_start_token                          len <= prompt_tokens

Each filler sentence, the needle and the question start with a space, so the pieces tokenize as the whole
text does (checked against SmolLM2's tokenizer in the tests).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from kvrelay.engine.long_context import LongContextConfig

if TYPE_CHECKING:
    from kvrelay.engine.engine import LLMEngine
    from kvrelay.engine.model_runner import ModelRunner, StepLogits
    from kvrelay.engine.scheduler import ScheduledStep
    from kvrelay.model.loader import LoadedModel
    from kvrelay.model.tokenizer import Tokenizer
    from kvrelay.transfer.nixl_agent import KvAgent

DEFAULT_MODEL_DIR = Path(".models") / "smollm2-135m-instruct"  # `make model`
TEXT_PATH = Path(__file__).resolve().parent / "long_context_texts" / "alice_chapters_1_2.txt"
BLOCK_SIZE_TOKENS = 16
# Defaults sized for under 10 minutes on 2 CPU cores (8.6 here): H2O's prefill (which sums attention weights)
# is the largest part, about 27 s for a 4k-token prompt against 8 s without a policy.
PASSKEY_LENGTHS = (1024, 2048, 4096)
PASSKEY_EXAMPLES = 2  # per length
PREFILL_TOKENS = 2048
SCORED_TOKENS = 512

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                    "There and back again.")
NEEDLE = "The pass key is {passkey}. Remember it. {passkey} is the pass key."
# Without "Answer with ...", SmolLM2 with full attention replied with filler to 3 of 4 prompts of 2k tokens whose
# needle sat in the first fifth ("a magical item ...", "the sun."); with it, to none.
QUESTION = "What is the pass key? Answer with the 5-digit number."
ANSWER_PREFIX = "The pass key is"
PASSKEY_RANGE = (10_000, 100_000)  # 5 digits

# ------------------------------------------------------------------ policies
PolicyFactory = Callable[[int, int], LongContextConfig]  # (budget_blocks, block_size_tokens) → config


def h2o_policy(budget_blocks: int, bs: int) -> LongContextConfig:
    """H2O keeping one sink and one recent block, at ``budget_blocks`` or the least it runs in (3)."""
    return LongContextConfig("h2o", max(budget_blocks, 3) * bs, bs, bs)


def infinigen_policy(budget_blocks: int, bs: int) -> LongContextConfig:
    """InfiniGen with one sink and one recent block; every block the budget leaves after sink, recent and
    the next token's block is a staging block (at least one: 4 blocks)."""
    blocks = max(budget_blocks, 4)
    return LongContextConfig("infinigen", blocks * bs, bs, bs, recall_blocks=blocks - 3)


def speculative_policy(budget_blocks: int, bs: int) -> LongContextConfig:
    """InfiniGen as the paper does it (``selection: speculative``) in the same blocks as `infinigen_policy`:
    its staging blocks hold ``recall_blocks * bs`` speculated tokens per layer."""
    return dataclasses.replace(infinigen_policy(budget_blocks, bs), selection="speculative")


# Each policy a sweep runs against full attention: (label, factory); another variant is one more line.
POLICIES: tuple[tuple[str, PolicyFactory], ...] = (("h2o", h2o_policy), ("infinigen", infinigen_policy),
                                                   ("infinigen-speculative", speculative_policy))


def budget_blocks(frac: float, prompt_tokens: int, bs: int) -> int:
    """``frac`` of a prompt in whole blocks of ``bs`` tokens, at least one (the factories raise it further)."""
    return max(int(frac * prompt_tokens) // bs, 1)


def select_policies(labels: Sequence[str] | None) -> tuple[tuple[str, PolicyFactory], ...]:
    """The `POLICIES` entries named by ``labels`` (all when None), in `POLICIES` order.

    Raises:
        ValueError: a label not in `POLICIES` (``none``, the reference, always runs and is ignored here).
    """
    if labels is None:
        return POLICIES
    known = {label for label, _ in POLICIES}
    unknown = [label for label in labels if label not in known and label != "none"]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; choose from none, {', '.join(sorted(known))}")
    return tuple((label, f) for label, f in POLICIES if label in labels)


# ------------------------------------------------------------------ passkey task
@dataclass(frozen=True, slots=True)
class PasskeyExample:
    """One passkey prompt of at most ``target_tokens`` ids. ``needle_start_token``: where the needle's
    ``needle_tokens`` ids start in ``prompt_ids``; ``depth_frac``: the share of the filler tokens that
    precede it (as placed, within one sentence of the depth asked for)."""

    prompt_ids: list[int]
    target_tokens: int
    passkey: str
    needle_start_token: int
    needle_tokens: int
    depth_frac: float


@dataclass(frozen=True, slots=True)
class _PromptPieces:
    head: list[int]
    sentences: list[list[int]]
    tail: list[int]


def _pieces(tokenizer: Tokenizer) -> _PromptPieces:
    marker = "\x00"
    frame = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True)
    before, after = frame.split(marker)
    enc = tokenizer.encode
    return _PromptPieces(head=enc(before + INTRO, add_special_tokens=False),
                         sentences=[enc(" " + s, add_special_tokens=False) for s in FILLER_SENTENCES],
                         tail=enc(" " + QUESTION + after + ANSWER_PREFIX, add_special_tokens=False))


def make_passkey(tokenizer: Tokenizer, *, prompt_tokens: int, depth_frac: float, passkey: str) -> PasskeyExample:
    """A prompt of at most ``prompt_tokens`` ids (less by under one filler sentence) with the needle after
    the filler sentence boundary nearest ``depth_frac`` of the filler tokens.

    ``tokenizer``: one with a chat template.

    Raises:
        ValueError: ``depth_frac`` outside [0, 1], or ``prompt_tokens`` too short for one filler sentence.
    """
    if not 0.0 <= depth_frac <= 1.0:
        raise ValueError(f"depth_frac must be in [0, 1], got {depth_frac!r}")
    pieces = _pieces(tokenizer)
    needle = tokenizer.encode(" " + NEEDLE.format(passkey=passkey), add_special_tokens=False)
    room = prompt_tokens - len(pieces.head) - len(needle) - len(pieces.tail)
    filler: list[list[int]] = []
    used = 0
    while used + len(pieces.sentences[len(filler) % len(pieces.sentences)]) <= room:
        filler.append(pieces.sentences[len(filler) % len(pieces.sentences)])
        used += len(filler[-1])
    if not filler:
        raise ValueError(f"prompt_tokens={prompt_tokens} leaves no room for filler; use at least "
                         f"{prompt_tokens - room + len(pieces.sentences[0])}")
    bounds = [0]
    for sentence in filler:
        bounds.append(bounds[-1] + len(sentence))
    cut = min(range(len(bounds)), key=lambda i: abs(bounds[i] - depth_frac * used))
    ids = pieces.head + [t for s in filler[:cut] for t in s] + needle + [t for s in filler[cut:] for t in s]
    return PasskeyExample(ids + pieces.tail, prompt_tokens, passkey, len(pieces.head) + bounds[cut], len(needle),
                          bounds[cut] / used)


def make_passkey_examples(tokenizer: Tokenizer, *, lengths: Sequence[int], per_length: int,
                          seed: int) -> list[PasskeyExample]:
    """``per_length`` examples at each of ``lengths`` (prompt tokens), in that order; example ``i`` of a length
    puts its needle at a depth drawn uniformly from ``[i / per_length, (i + 1) / per_length]`` (every depth
    band covered) and its passkey uniformly from 5-digit numbers. Same arguments, same examples."""
    rng = random.Random(seed)
    return [make_passkey(tokenizer, prompt_tokens=n, depth_frac=(i + rng.random()) / per_length,
                         passkey=str(rng.randrange(*PASSKEY_RANGE)))
            for n in lengths for i in range(per_length)]


def parse_passkey(text: str) -> str | None:
    """The first run of digits in a reply (``" 71432. Remember"`` → ``"71432"``), or None."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


# ------------------------------------------------------------------ engine runs
class _Node(NamedTuple):
    engine: LLMEngine
    agent: KvAgent  # the engine's offloads and recalls go through it, as on a node

    def close(self) -> None:
        self.agent.close()
        self.engine.close()


def _node(loaded: LoadedModel, *, bs: int, num_seqs: int, tokens_per_seq: int, name: str) -> _Node:
    """An engine whose host tier is as large as its device pool, which holds every sequence's whole KV (so
    nothing is preempted), with its NIXL agent."""
    gc.collect()  # the previous run's engine: its pools sit in reference cycles, gigabytes the collector may not
    # reach on its own before this one allocates (measured: RSS grew by 2.3 GB per passkey run, 15 GB by the 8th)
    from kvrelay.engine.engine import EngineConfig, LLMEngine
    from kvrelay.kvstore.tiered_store import TieredStoreConfig
    from kvrelay.transfer.node_agent import make_agent

    blocks = num_seqs * (-(-tokens_per_seq // bs) + 2) + 8
    eng = LLMEngine(loaded, EngineConfig(num_blocks=blocks, block_size_tokens=bs, max_num_seqs=num_seqs,
                                         max_num_batched_tokens=4096, enable_prefix_caching=False),
                    store_config=TieredStoreConfig(num_device_blocks=blocks, num_host_blocks=blocks,
                                                   watermark_blocks=0))
    return _Node(eng, make_agent(eng, name))


@dataclass(frozen=True, slots=True)
class Generation:
    """Greedy outputs in prompt order; decode seconds per step once every prompt is prefilled."""

    outputs: list[list[int]]
    decode_s_per_step: float
    stats: dict[str, int]
    decode_steps: int


def generate(loaded: LoadedModel, prompts: list[list[int]], policies: list[LongContextConfig], *, answer_tokens: int,
             bs: int = BLOCK_SIZE_TOKENS) -> Generation:
    """All prompts in one batch, prompt ``i`` under ``policies[i]``; ``answer_tokens`` tokens each."""
    from kvrelay.model.sampling import SamplingParams

    node = _node(loaded, bs=bs, num_seqs=len(prompts), tokens_per_seq=max(map(len, prompts)) + answer_tokens,
                 name="bench-long-context-real")
    eng = node.engine
    ids = [f"p{i}" for i in range(len(prompts))]
    params = SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
    for rid, prompt, policy in zip(ids, prompts, policies, strict=True):
        eng.add_request(rid, prompt, params, long_context=policy)
    outputs, decode_s, decode_steps = run_to_end(eng)
    stats = dataclasses.asdict(eng.policies.stats)
    node.close()
    return Generation([outputs[rid] for rid in ids], decode_s / max(decode_steps, 1), stats, decode_steps)


def run_to_end(eng: LLMEngine) -> tuple[dict[str, list[int]], float, int]:
    """Step ``eng`` until its requests finish: each request's tokens, and the seconds and number of the steps
    taken once every request decodes (all prefilled, none waiting)."""
    outputs: dict[str, list[int]] = {}
    decode_s, decode_steps = 0.0, 0
    while eng.has_unfinished():
        decoding = all(s.num_output_tokens > 0 for s in eng.scheduler.running) and not eng.scheduler.waiting
        t0 = time.perf_counter()
        outs = eng.step()
        if decoding:
            decode_s += time.perf_counter() - t0
            decode_steps += 1
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return outputs, decode_s, decode_steps


class _LogitsTap:
    """Stands in for an engine's `ModelRunner`: runs each step through it and keeps the step's logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.last: StepLogits | None = None

    def run(self, step: ScheduledStep, **kwargs: Any) -> StepLogits:
        self.last = self.runner.run(step, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


@dataclass(frozen=True, slots=True)
class TeacherForced:
    """Per scored token (``token_ids[prefill_tokens:]``): its NLL in nats and the model's top-1 prediction."""

    nll: list[float]
    top1_ids: list[int]
    decode_s_per_step: float
    stats: dict[str, int]
    decode_steps: int


def teacher_forced(loaded: LoadedModel, token_ids: list[int], *, prefill_tokens: int, policy: LongContextConfig,
                   bs: int = BLOCK_SIZE_TOKENS) -> TeacherForced:
    """Prefill ``token_ids[:prefill_tokens]``, then decode the rest of ``token_ids`` one per step under
    ``policy``, each step fed the text's token instead of the sampled one (module doc).

    The engine reports sampled tokens (and logprobs of those), not the logits of the token a text has next, and
    has no way to feed a chosen token; so this reads each step's logits through a `_LogitsTap` in place of the
    engine's runner, and between steps rewrites its one sequence's newest token, which no step has computed yet
    (prefix caching is off, so nothing has hashed it).

    Raises:
        ValueError: ``prefill_tokens`` not in ``[1, len(token_ids))``.
    """
    from kvrelay.model.sampling import SamplingParams

    if not 1 <= prefill_tokens < len(token_ids):
        raise ValueError(f"prefill_tokens must be in [1, {len(token_ids)}), got {prefill_tokens}")
    node = _node(loaded, bs=bs, num_seqs=1, tokens_per_seq=len(token_ids), name="bench-long-context-ppl")
    eng = node.engine
    tap = _LogitsTap(eng.runner)
    eng.runner = tap
    scored = len(token_ids) - prefill_tokens
    eng.add_request("text", token_ids[:prefill_tokens], SamplingParams(max_tokens=scored, ignore_eos=True),
                    long_context=policy)
    nll: list[float] = []
    top1: list[int] = []
    decode_s = 0.0
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        if nll:
            decode_s += time.perf_counter() - t0
        if not outs:  # a prefill chunk that is not the last (or a step whose token was dropped)
            continue
        (out,) = outs
        assert tap.last is not None
        (seq,) = tap.last.seqs
        logits = tap.last.logits[0].float()
        target = token_ids[prefill_tokens + len(nll)]
        nll.append(-float(torch.log_softmax(logits, dim=-1)[target]))
        top1.append(int(logits.argmax()))
        if not out.finished:
            seq.token_ids[-1] = target  # not computed yet: its KV is written by the next step
    stats = dataclasses.asdict(eng.policies.stats)
    node.close()
    return TeacherForced(nll, top1, decode_s / max(len(nll) - 1, 1), stats, max(len(nll) - 1, 0))


# ------------------------------------------------------------------ sweeps
def _passkey_rows(loaded: LoadedModel, tokenizer: Tokenizer, examples: list[PasskeyExample], *, fracs: Sequence[float],
                  policies: Sequence[tuple[str, PolicyFactory]], answer_tokens: int, bs: int) -> list[dict[str, Any]]:
    prompts = [e.prompt_ids for e in examples]

    def row(label: str, frac: float, gen: Generation, reference: list[str | None] | None) -> dict[str, Any]:
        answers = [parse_passkey(tokenizer.decode(out)) for out in gen.outputs]
        right = [a == e.passkey for a, e in zip(answers, examples)]
        by_length: dict[int, list[bool]] = {}
        for e, ok in zip(examples, right):
            by_length.setdefault(e.target_tokens, []).append(ok)
        agree = [a == r for a, r in zip(answers, reference or answers)]
        return {"policy": label, "budget_frac": frac, "accuracy": _mean(right),
                "accuracy_by_length": {n: _mean(v) for n, v in by_length.items()},
                "agreement": _mean(agree), "answers": answers,
                "decode_ms_per_step": round(gen.decode_s_per_step * 1e3, 2), "policy_stats": gen.stats,
                "recalled_bytes_per_step": recalled_bytes_per_step(loaded, gen.stats, gen.decode_steps, bs)}

    full = generate(loaded, prompts, [LongContextConfig()] * len(prompts), answer_tokens=answer_tokens, bs=bs)
    rows = [row("none", 1.0, full, None)]
    rows[0]["replies"] = [tokenizer.decode(out) for out in full.outputs]
    reference = rows[0]["answers"]
    for frac in fracs:
        for label, factory in policies:
            configs = [factory(budget_blocks(frac, len(p), bs), bs) for p in prompts]
            gen = generate(loaded, prompts, configs, answer_tokens=answer_tokens, bs=bs)
            r = row(label, frac, gen, reference)
            r["device_budget_tokens"] = sorted({c.device_budget_tokens for c in configs})
            r["step_time_vs_none"] = round(gen.decode_s_per_step / full.decode_s_per_step, 2)
            rows.append(r)
    return rows


def _perplexity_rows(loaded: LoadedModel, token_ids: list[int], *, prefill_tokens: int, fracs: Sequence[float],
                     policies: Sequence[tuple[str, PolicyFactory]], bs: int) -> list[dict[str, Any]]:
    def row(label: str, frac: float, tf: TeacherForced, reference: TeacherForced | None) -> dict[str, Any]:
        mean = sum(tf.nll) / len(tf.nll)
        targets = token_ids[prefill_tokens:]
        ref = reference or tf
        return {"policy": label, "budget_frac": frac, "perplexity": round(math.exp(mean), 4),
                "nll_mean": round(mean, 5), "perplexity_vs_none": round(math.exp(mean - _mean_nll(ref)), 4),
                "top1_accuracy": _mean([p == t for p, t in zip(tf.top1_ids, targets)]),
                "top1_agreement": _mean([p == q for p, q in zip(tf.top1_ids, ref.top1_ids)]),
                "max_nll_increase": round(max(a - b for a, b in zip(tf.nll, ref.nll)), 4),
                "decode_ms_per_step": round(tf.decode_s_per_step * 1e3, 2), "policy_stats": tf.stats,
                "recalled_bytes_per_step": recalled_bytes_per_step(loaded, tf.stats, tf.decode_steps, bs)}

    full = teacher_forced(loaded, token_ids, prefill_tokens=prefill_tokens, policy=LongContextConfig(), bs=bs)
    rows = [row("none", 1.0, full, None)]
    for frac in fracs:
        for label, factory in policies:
            policy = factory(budget_blocks(frac, prefill_tokens, bs), bs)
            tf = teacher_forced(loaded, token_ids, prefill_tokens=prefill_tokens, policy=policy, bs=bs)
            r = row(label, frac, tf, full)
            r["device_budget_tokens"] = policy.device_budget_tokens
            r["step_time_vs_none"] = round(tf.decode_s_per_step / full.decode_s_per_step, 2)
            rows.append(r)
    return rows


def recalled_bytes_per_step(loaded: LoadedModel, stats: dict[str, int], decode_steps: int, bs: int) -> int:
    """Host → device recall bytes per decode step of the batch: (block, layer) slices of ``selection:
    blocks`` and (token, layer) rows of ``speculative`` (`engine.policy_api.LongContextStats`)."""
    cfg = loaded.config
    row_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * next(loaded.model.parameters()).element_size()
    total = stats["recalled_layer_blocks"] * bs * row_bytes + stats["recalled_token_rows"] * row_bytes
    return round(total / max(decode_steps, 1))


def _mean(values: Sequence[bool]) -> float:
    return round(sum(values) / max(len(values), 1), 4)


def _mean_nll(tf: TeacherForced) -> float:
    return sum(tf.nll) / len(tf.nll)


def text_token_ids(tokenizer: Tokenizer, *, num_tokens: int, path: Path = TEXT_PATH) -> list[int]:
    """The first ``num_tokens`` token ids of the text at ``path`` (no special tokens).

    Raises:
        ValueError: the text is shorter than ``num_tokens``.
    """
    ids = tokenizer.encode(path.read_text(), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than the {num_tokens} asked for; lower "
                         f"--prefill-tokens or --scored-tokens")
    return ids[:num_tokens]


def run(*, model_dir: str | Path = DEFAULT_MODEL_DIR, tasks: Sequence[str] = ("passkey", "perplexity"),
        lengths: Sequence[int] = PASSKEY_LENGTHS, passkey_examples: int = PASSKEY_EXAMPLES, answer_tokens: int = 8,
        prefill_tokens: int = PREFILL_TOKENS, scored_tokens: int = SCORED_TOKENS,
        fracs: Sequence[float] = (0.1, 0.2, 0.5), policies: Sequence[str] | None = None, seed: int = 12345,
        bs: int = BLOCK_SIZE_TOKENS) -> dict[str, Any]:
    """The sweeps of ``tasks`` on the model at ``model_dir`` (float32, CPU).

    Raises:
        FileNotFoundError: no model at ``model_dir`` (``make model`` writes the default one).
        ValueError: an unknown task or policy label; a model without a tokenizer or chat template.
    """
    from kvrelay.benchmarks.common import machine_label
    from kvrelay.model.loader import load_model
    from kvrelay.model.tokenizer import load_tokenizer

    unknown = sorted(set(tasks) - {"passkey", "perplexity"})
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; choose from passkey, perplexity")
    chosen = select_policies(policies)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model at {model_dir}; run `make model` (SmolLM2-135M-Instruct) or pass "
                                f"--real-model-dir")
    loaded = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None or tokenizer.chat_template is None:
        raise ValueError(f"{model_dir} has no tokenizer.json with a chat template; the passkey task needs both")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"bench": "long-context-real", **machine_label(), "model": str(model_dir),
                              "block_size_tokens": bs, "sink_and_recent": "one block each", "seed": seed,
                              "threads": torch.get_num_threads()}
    if "passkey" in tasks:
        examples = make_passkey_examples(tokenizer, lengths=lengths, per_length=passkey_examples, seed=seed)
        result["passkey"] = {
            "lengths": list(lengths), "examples_per_length": passkey_examples, "answer_tokens": answer_tokens,
            "examples": [{"prompt_tokens": len(e.prompt_ids), "depth_frac": round(e.depth_frac, 3),
                          "needle_start_token": e.needle_start_token, "passkey": e.passkey} for e in examples],
            "rows": _passkey_rows(loaded, tokenizer, examples, fracs=fracs, policies=chosen,
                                  answer_tokens=answer_tokens, bs=bs)}
    if "perplexity" in tasks:
        ids = text_token_ids(tokenizer, num_tokens=prefill_tokens + scored_tokens)
        result["perplexity"] = {
            "text": TEXT_PATH.name, "prefill_tokens": prefill_tokens, "scored_tokens": scored_tokens,
            "rows": _perplexity_rows(loaded, ids, prefill_tokens=prefill_tokens, fracs=fracs, policies=chosen,
                                     bs=bs)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result
