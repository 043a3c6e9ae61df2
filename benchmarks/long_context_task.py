"""A retrieval task that needs sharp long-range attention, and a tiny Llama trained on it (cached).

A random-weight model attends diffusely, so a KV policy that drops the wrong blocks hardly changes
its output. This module trains one that cannot afford to: every answer token needs attention on one
specific position far back in the prompt.

Task (copy with distinct tokens)::

    prompt  = [BOS] run[0] run[1] ... run[N-1] [SEP] run[s] run[s+1] run[s+2] run[s+3]
    answer  = run[s+4] run[s+5] ... run[s+3+A]

``run`` is ``N = context_tokens`` ids drawn without replacement from the content vocabulary (each
occurs once), ``s`` is uniform over the places where cue and answer fit, ``A = answer_tokens``. Each
answer token is the successor, in the run, of the token before it (induction: find where the current
token occurred, copy the next one), so a model that lost the block holding it cannot know it, and
after one wrong token the rest of the answer follows the wrong place.

Vocabulary (on top of `model.tiny`'s byte tokenizer; prompts are token ids, never text)::

    0..255 bytes (unused)   256 BOS   257 EOS (unused)   258 SEP   259..259+2047 content

Training (`ensure_model`, once per cache directory) runs a length curriculum (`TrainConfig.stages`):
runs of 24 tokens until induction forms, then longer runs with several cue/answer segments each
(more scored tokens per step), and last the task's own format at 512, 768 and 1024 with the learning
rate annealed. It takes about 1300 steps, 2–4 minutes on one CPU thread, and is deterministic for a
seed on a given machine (one thread, seeded generators, stopping decided by steps and held-out
accuracy, never by time). The model handles runs up to 1024 tokens (the trained range); far beyond,
its accuracy collapses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from kvrelay.benchmarks.long_context_train import LlamaShape, TrainingLlama, export_hf
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tiny import BOS_ID

TASK_VERSION = 1  # bump when the task, the model code or the training loop changes what gets trained
SEP_ID = 258
CONTENT_BASE_ID = 259
CONTENT_VOCAB = 2048
VOCAB_SIZE = CONTENT_BASE_ID + CONTENT_VOCAB
CUE_TOKENS = 4
HELDOUT_SEED_OFFSET = 1_000_003  # training's held-out examples: make_examples(seed=seed + this)


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt and the tokens a perfect model generates greedily after it."""

    prompt_ids: list[int]
    answer_ids: list[int]


def make_examples(num: int, *, seed: int, context_tokens: int, answer_tokens: int) -> list[Example]:
    """``num`` task examples (module doc); the same arguments give the same examples.

    Prompts are ``context_tokens + 2 + CUE_TOKENS`` long, answers ``answer_tokens``.

    Raises:
        ValueError: ``context_tokens`` above `CONTENT_VOCAB` or too short to hold cue and answer.
    """
    if not CUE_TOKENS + answer_tokens <= context_tokens <= CONTENT_VOCAB:
        raise ValueError(f"context_tokens must be in [{CUE_TOKENS + answer_tokens}, {CONTENT_VOCAB}] for "
                         f"answer_tokens={answer_tokens}, got {context_tokens}")
    rng = random.Random(seed)
    examples = []
    for _ in range(num):
        run = [CONTENT_BASE_ID + t for t in rng.sample(range(CONTENT_VOCAB), context_tokens)]
        start = rng.randrange(context_tokens - CUE_TOKENS - answer_tokens + 1)
        cue_end = start + CUE_TOKENS
        examples.append(Example(prompt_ids=[BOS_ID, *run, SEP_ID, *run[start:cue_end]],
                                answer_ids=run[cue_end:cue_end + answer_tokens]))
    return examples


@dataclass(frozen=True, slots=True)
class TrainBatch:
    """``input_ids`` ``[B, T]`` int64; ``target_ids`` ``[B, T]`` the next token where it is scored, else -1."""

    input_ids: torch.Tensor
    target_ids: torch.Tensor


def training_batch(
    gen: torch.Generator, *, batch_size: int, context_tokens: int, segments: int, segment_tokens: int
) -> TrainBatch:
    """Runs of ``N = context_tokens`` followed by ``K = segments`` segments ``[SEP] run[s:s+L]``.

    The run is cut into ``K`` equal chunks, each segment copies a random span of its own chunk (so no
    token occurs in two segments), and the segments come in shuffled order::

        [BOS] run (N) | [SEP] run[s2:s2+L] | [SEP] run[s0:s0+L] | ... (last token dropped)

    Scored: every segment token after its first (all follow from the run by induction).
    """
    n, k, length = context_tokens, segments, segment_tokens
    if n < k * length:
        raise ValueError(f"{k} segments of {length} tokens do not fit in {n} context tokens")
    runs = torch.rand(batch_size, CONTENT_VOCAB, generator=gen).argsort(dim=1)[:, :n] + CONTENT_BASE_ID
    chunk = n // k
    starts = torch.randint(0, chunk - length + 1, (batch_size, k), generator=gen) + torch.arange(k) * chunk
    starts = starts.gather(1, torch.rand(batch_size, k, generator=gen).argsort(dim=1))
    spans = runs.gather(1, (starts[:, :, None] + torch.arange(length)).view(batch_size, -1)).view(batch_size, k, -1)
    tail = torch.cat([torch.full((batch_size, k, 1), SEP_ID), spans], dim=2).view(batch_size, -1)
    ids = torch.cat([torch.full((batch_size, 1), BOS_ID), runs, tail], dim=1)
    targets = torch.full_like(ids, -1)
    first = 1 + n + 1 + torch.arange(k)[:, None] * (length + 1)  # each segment's first copied token
    scored = (first + torch.arange(length - 1)).view(-1)
    targets[:, scored] = ids[:, scored + 1]
    return TrainBatch(ids[:, :-1], targets[:, :-1])


@dataclass(frozen=True, slots=True)
class Stage:
    """One curriculum stage: ``max_steps`` steps, cycling through the run lengths ``context_tokens``.

    Ends early once the held-out accuracy at the last length reaches ``target_acc`` (checked every
    ``TrainConfig.eval_every_steps``; None: no early end, measured once at the end). ``segments``
    cue/answer segments follow each run (`training_batch`): 1 is the `make_examples` format (the
    answer's source anywhere in the run, right before the query); more give more scored tokens per
    step but push the sources further back. The learning rate goes linearly from ``lr`` to ``end_lr``
    (None: stays at ``lr``) over ``max_steps``.
    """

    context_tokens: tuple[int, ...]
    batch_size: int
    segments: int
    max_steps: int
    target_acc: float | None
    lr: float
    end_lr: float | None = None


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Everything that decides the trained weights (with the seed and `TASK_VERSION`)."""

    shape: LlamaShape = LlamaShape(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=128,
                                   num_layers=2, num_heads=4, num_kv_heads=2)
    stages: tuple[Stage, ...] = (
        Stage((24,), 32, 1, 2000, 0.9, 3e-3),  # the slow part: induction forms (~800 steps)
        Stage((64,), 32, 1, 100, 0.99, 3e-3),
        Stage((128,), 16, 2, 100, 0.99, 3e-3),
        Stage((256,), 8, 4, 100, 0.99, 3e-3),
        Stage((512,), 4, 8, 200, 0.995, 3e-3),
        Stage((1024,), 2, 16, 200, 0.995, 3e-3),
        Stage((512, 768, 1024), 4, 1, 300, None, 1e-3, end_lr=1e-4),  # the task's own format, annealed
    )
    segment_tokens: int = CUE_TOKENS + 32  # cue + answer per segment; less where chunks are short (N // 2K)
    eval_every_steps: int = 25
    eval_examples: int = 32
    eval_answer_tokens: int = 32
    threads: int = 1  # more oversubscribes a shared machine, slowing small ops by 10x or worse

    def digest(self, seed: int) -> str:
        blob = json.dumps({"task_version": TASK_VERSION, "seed": seed, "config": asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class TrainResult:
    """The trained model and ``train_report.json``'s content (steps, seconds, losses, accuracies)."""

    model: TrainingLlama
    report: dict


def train(config: TrainConfig, *, seed: int) -> TrainResult:
    """Train a model on the curriculum; prints one line per evaluation.

    Deterministic for ``(config, seed)`` on one machine: the global RNG is forked for the init, data
    comes from its own generator, and torch runs ``config.threads`` threads (restored afterwards).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _train(config, seed)
    finally:
        torch.set_num_threads(threads)


def _train(config: TrainConfig, seed: int) -> TrainResult:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TrainingLlama(config.shape)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.stages[0].lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0 = time.perf_counter()
    step, loss, stages = 0, float("nan"), []
    for stage in config.stages:
        heldout = _heldout(config, seed, stage.context_tokens[-1])
        end_lr = stage.lr if stage.end_lr is None else stage.end_lr
        acc, stage_steps = float("nan"), 0
        while stage_steps < stage.max_steps:
            for group in opt.param_groups:
                group["lr"] = stage.lr + (end_lr - stage.lr) * stage_steps / stage.max_steps
            n = stage.context_tokens[stage_steps % len(stage.context_tokens)]
            batch = training_batch(gen, batch_size=stage.batch_size, context_tokens=n, segments=stage.segments,
                                   segment_tokens=min(config.segment_tokens, n // (2 * stage.segments)))
            loss = _train_step(model, opt, batch)
            step, stage_steps = step + 1, stage_steps + 1
            last = stage_steps == stage.max_steps
            if stage_steps % config.eval_every_steps and not last:
                continue
            measured = stage.target_acc is not None or last
            if measured:
                acc = teacher_forced_accuracy(model, heldout)
            note = f", held-out acc {acc:.4f} at {stage.context_tokens[-1]}" if measured else ""
            print(f"long-context train: step {step} context {n} loss {loss:.4f}{note} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            if stage.target_acc is not None and acc >= stage.target_acc:
                break
        stages.append({"context_tokens": list(stage.context_tokens), "segments": stage.segments,
                       "steps": stage_steps, "heldout_accuracy": acc})
    final = config.stages[-1].context_tokens
    by_context = {n: teacher_forced_accuracy(model, _heldout(config, seed, n)) for n in final}
    report = {
        "seed": seed, "task_version": TASK_VERSION, "digest": config.digest(seed), "steps": step,
        "seconds": round(time.perf_counter() - t0, 1), "final_loss": round(loss, 5),
        "eval_context_tokens": final[-1], "heldout_accuracy": by_context[final[-1]],
        "heldout_accuracy_by_context": by_context,
        "heldout_seed": seed + HELDOUT_SEED_OFFSET, "heldout_metric": "teacher-forced answer token accuracy",
        "stages": stages, "threads": config.threads, "torch": torch.__version__, "config": asdict(config),
    }
    return TrainResult(model, report)


def _heldout(config: TrainConfig, seed: int, context_tokens: int) -> list[Example]:
    answer_tokens = min(config.eval_answer_tokens, context_tokens - CUE_TOKENS)
    return make_examples(config.eval_examples, seed=seed + HELDOUT_SEED_OFFSET, context_tokens=context_tokens,
                         answer_tokens=answer_tokens)


def _train_step(model: TrainingLlama, opt: torch.optim.Optimizer, batch: TrainBatch) -> float:
    scored = batch.target_ids >= 0
    hidden = model(batch.input_ids)[scored]
    loss = F.cross_entropy(model.lm_head(hidden), batch.target_ids[scored])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


@torch.no_grad()
def teacher_forced_accuracy(model: TrainingLlama, examples: list[Example], *, chunk: int = 8) -> float:
    """Share of answer tokens that are the argmax after ``prompt + answer[:i]`` (examples of equal shape).

    Equals greedy generation's token accuracy when every token is right; below that it is higher,
    since greedy decoding does not recover from a wrong token.
    """
    right = total = 0
    for i in range(0, len(examples), chunk):
        part = examples[i:i + chunk]
        ids = torch.tensor([e.prompt_ids + e.answer_ids[:-1] for e in part])
        answers = torch.tensor([e.answer_ids for e in part])
        first = len(part[0].prompt_ids) - 1
        hidden = model(ids)[:, first:first + answers.shape[1]]
        right += int((model.lm_head(hidden).argmax(-1) == answers).sum())
        total += answers.numel()
    return right / total


def ensure_model(cache_dir: Path, *, seed: int = 0, force: bool = False) -> Path:
    """The trained model directory ``cache_dir / f"long-context-{digest}"``; trains it if missing.

    The directory is a Hugging Face Llama `model.loader.load_model` loads (see
    `benchmarks.long_context_train.export_hf`) plus ``train_report.json``. It is written under a
    temporary name and renamed into place, so an interrupted run leaves no half model. ``force``
    retrains and replaces it.
    """
    config = TrainConfig()
    out = Path(cache_dir) / f"long-context-{config.digest(seed)}"
    if out.is_dir() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"long-context: training {out.name} (seed {seed}; a few minutes on CPU, once)", flush=True)
    result = train(config, seed=seed)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_hf(result.model, tmp)
        (tmp / "train_report.json").write_text(json.dumps(result.report, indent=2) + "\n")
        if out.is_dir():  # force, or another process finished first: same seed, same weights
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"long-context: wrote {out} in {result.report['seconds']}s; held-out accuracy "
          f"{result.report['heldout_accuracy']:.4f} at {result.report['eval_context_tokens']} context tokens",
          flush=True)
    return out


def evaluate_full_attention(model_dir: Path, examples: list[Example], *, block_size_tokens: int = 16) -> float:
    """Token accuracy of the serving engine's greedy output (full attention, no KV policy) vs the answers.

    All examples run as one batch; generation ignores EOS and stops after ``len(answer_ids)`` tokens.
    """
    def blocks(e: Example) -> int:
        return -(-(len(e.prompt_ids) + len(e.answer_ids)) // block_size_tokens)

    longest = max(len(e.prompt_ids) for e in examples)
    engine = LLMEngine(load_model(model_dir), EngineConfig(
        num_blocks=sum(blocks(e) for e in examples) + 1, block_size_tokens=block_size_tokens,
        max_num_seqs=len(examples), max_num_batched_tokens=max(2048, longest)))
    try:
        params = [SamplingParams(max_tokens=len(e.answer_ids), temperature=0.0, ignore_eos=True) for e in examples]
        outputs = engine.generate([e.prompt_ids for e in examples], params)
    finally:
        engine.close()
    right = sum(o == a for e, out in zip(examples, outputs) for o, a in zip(out[0], e.answer_ids))
    return right / sum(len(e.answer_ids) for e in examples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=".models")
    p.add_argument("--seed", type=int, default=0, help="training seed")
    p.add_argument("--force", action="store_true", help="retrain even if cached")
    p.add_argument("--context-tokens", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--examples", type=int, default=32)
    p.add_argument("--eval-seed", type=int, default=12345)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    model_dir = ensure_model(Path(a.cache_dir), seed=a.seed, force=a.force)
    print(f"model {model_dir} ready in {time.perf_counter() - t0:.1f}s", flush=True)
    for n in a.context_tokens:
        examples = make_examples(a.examples, seed=a.eval_seed, context_tokens=n, answer_tokens=a.answer_tokens)
        acc = evaluate_full_attention(model_dir, examples)
        print(f"full attention, {n} context tokens, {a.examples} examples: token accuracy {acc:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
