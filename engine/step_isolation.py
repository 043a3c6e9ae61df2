"""After a step raised: find the request(s) that make a step fail, fail those alone, and let the rest go on.

What a failed `LLMEngine.step` leaves, and why a retry is correct:

* blocks allocated for its batch, KV written to some of their slots, computed-token counts advanced (when it
  failed after the forward), children of ``n > 1`` requests forked: `reset` preempts every running sequence,
  so its blocks go back and its KV is recomputed from its tokens (full blocks keyed before the failure hold KV
  of steps that succeeded: their prefix-cache hits are sound);
* never a token without its output: `LLMEngine.step` hands the outputs a failed step had made (earlier
  finishes, tokens appended before it raised) to the next step. A grammar matcher advances only with its
  sequence's token, so it is at the sequence's tokens too;
* sampling is keyed by seed, sample and output position (`model.sampling`) and a sample's tokens do not
  depend on its batch (float32 here: `tests/engine/test_engine.py`), so a survivor's tokens are those of a
  run that never failed.

Then `try_alone` steps one request at a time, the others set aside, until it has sampled (its KV is whole
again and it took the step the batch failed in) or finished: a request whose step raises again is a culprit.
Each request costs one recompute of its uncached tail; a failure no request repeats alone (a transient
fault) fails nobody.
"""

from __future__ import annotations

from kvrelay.engine.engine import LLMEngine, StepOutput

MAX_STEPS_ALONE = 256  # steps one request may take alone before it counts as innocent (its prefill chunks)


def reset(engine: LLMEngine) -> list[str]:
    """Preempt every running sequence of ``engine`` after a step raised (their KV is recomputed). Returns the
    ids of the requests still unfinished, in arrival order."""
    sch = engine.scheduler
    for seq in list(sch.running):
        sch.preempt(seq)
    ids: list[str] = []
    for seq in sorted(sch.waiting, key=lambda s: s.arrival):
        if seq.request_id not in ids:
            ids.append(seq.request_id)
    return ids


def try_alone(engine: LLMEngine, request_id: str) -> tuple[list[StepOutput], BaseException | None]:
    """Step ``engine`` with only ``request_id``'s sequences schedulable (the others set aside, then put back),
    until each of its samples has sampled a token (the step its batch failed in) or it finished. Returns the
    outputs of those steps (for every request: outputs held over from a failed step come with them), and the
    error its step raised, if one did: the request is then the culprit, still in the engine (the caller aborts
    it), its running sequences preempted (`reset`)."""
    sch = engine.scheduler
    waiting_aside = [s for s in sch.waiting if s.request_id != request_id]
    running_aside = [s for s in sch.running if s.request_id != request_id]
    sch.waiting = [s for s in sch.waiting if s.request_id == request_id]
    sch.running = [s for s in sch.running if s.request_id == request_id]
    outputs: list[StepOutput] = []
    sampled: set[int] = set()
    try:
        for _ in range(MAX_STEPS_ALONE):
            steps = engine.stats.steps
            try:
                outs = engine.step()
            except Exception as exc:  # noqa: BLE001 - the caller fails this request with it
                reset(engine)
                return outputs, exc
            outputs.extend(outs)
            sampled.update(o.index for o in outs if o.request_id == request_id)
            mine = [s for s in (*sch.running, *sch.waiting) if s.request_id == request_id]
            if not engine.is_active(request_id) or all(s.index in sampled for s in mine):
                break
            if engine.stats.steps == steps:  # nothing could run (blocks held elsewhere): try it with the rest
                break
        return outputs, None
    finally:
        sch.waiting = sorted([*sch.waiting, *waiting_aside], key=lambda s: s.arrival)
        sch.running = sorted([*sch.running, *running_aside], key=lambda s: s.arrival)

