"""Issue 65: a step that raises fails only the request(s) that make it fail (`engine.step_isolation`); the rest
of the batch finishes with the tokens of a run that never failed, and every block comes back."""

from __future__ import annotations

import asyncio
import random

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.worker import EngineFailure, EngineWorker
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.structured import StructuredOutput

POISON = [250, 251, 252, 253]  # a prompt that starts so fails every step it decodes in (after 3 tokens)


def poison(engine: LLMEngine) -> list[int]:
    """Make ``engine``'s forward raise whenever a sequence whose prompt starts with `POISON` decodes past its
    third output token (a fault of one request, as an out-of-range index in a kernel would be). Returns a list
    that counts the raises."""
    run, raised = engine.runner.run, []

    def poisoned_run(step, **kwargs):
        seqs = [c.seq for c in step.prefills] + list(step.decodes)
        if any(s.token_ids[:len(POISON)] == POISON and s.num_output_tokens >= 3 for s in seqs):
            raised.append(len(seqs))
            raise IndexError("index 4242 is out of bounds for dimension 0 with size 258")
        return run(step, **kwargs)

    engine.runner.run = poisoned_run
    return raised


async def _collect(stream) -> dict[int, list[int]] | Exception:
    out: dict[int, list[int]] = {}
    try:
        async for item in stream:
            out.setdefault(item.index, []).extend(item.new_token_ids)
    except EngineFailure as exc:
        return exc
    return out


@pytest.mark.parametrize("n_poison", [1, 2])
def test_a_poison_request_fails_alone_and_20_others_finish_as_an_undisturbed_run(tiny_model_dir, n_poison):
    loaded = load_model(tiny_model_dir)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 40))] for _ in range(20)]
    # greedy, seeded samples and n=2 with a seed: each kind must continue exactly
    params = [SamplingParams(max_tokens=40, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.9, seed=100 + i) if i % 3 == 1
              else SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, n=2, seed=100 + i)
              for i in range(20)]
    # and two constrained samples: their grammar matchers must be where their tokens are after the retry
    regex = StructuredOutput("regex", r"[a-e]{25,35}")
    params[18] = SamplingParams(max_tokens=40, structured_outputs=regex)
    params[19] = SamplingParams(max_tokens=40, temperature=1.0, seed=7, structured_outputs=regex)
    config = EngineConfig(num_blocks=256, max_num_seqs=64)
    clean = LLMEngine(loaded, config)
    expected = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        clean.add_request(f"r{i}", p, sp)
        expected[f"r{i}"] = {k: [] for k in range(sp.n)}
    while clean.has_unfinished():
        for o in clean.step():
            expected[o.request_id][o.index].extend(o.new_token_ids)

    async def main() -> None:
        engine = LLMEngine(loaded, config)
        raised = poison(engine)
        worker = EngineWorker(engine)
        worker.start()
        streams = {f"r{i}": worker.submit(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
        bad = {f"poison{j}": worker.submit(f"poison{j}", POISON + [7 + j] * 9, SamplingParams(max_tokens=40))
               for j in range(n_poison)}
        results = await asyncio.gather(*(_collect(s) for s in (*streams.values(), *bad.values())))
        got = dict(zip([*streams, *bad], results, strict=True))
        for rid in bad:
            assert isinstance(got[rid], EngineFailure) and got[rid].status == 500
            assert str(got[rid]).startswith("internal error: the engine step failed on this request (IndexError: "
                                            "index 4242 is out of bounds")
        assert {rid: got[rid] for rid in streams} == expected
        assert all(len(expected[f"r{i}"][0]) >= 25 for i in (18, 19))  # constrained, and went past the failure
        assert raised[0] >= 21  # it failed in a batch with the others
        assert len(raised) == 1 + n_poison  # once in the batch, then once alone per poison request
        in_use = await worker.call(lambda e: (e.check_integrity(), e.pool.stats().num_in_use)[1])
        assert in_use == 0
        assert worker.alive
        assert await _collect(worker.submit("after", [5, 6, 7], SamplingParams(max_tokens=4))) == {0: [
            *clean.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0][0]]}
        await worker.stop()

    asyncio.run(main())
