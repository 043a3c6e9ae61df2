"""EngineWorker: async streams, aborts, calls on the worker thread, refused requests."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine, RequestError
from kvrelay.engine.worker import CallerThreadHost, EngineFailure, EngineWorker
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams


async def _collect(stream) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for item in stream:
        out.setdefault(item.index, []).extend(item.new_token_ids)
    return out


def test_concurrent_streams_match_offline_and_abort_frees_blocks(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], [12] * 40]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    offline = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate(prompts, params)

    async def main() -> None:
        worker = EngineWorker(LLMEngine(loaded, EngineConfig(num_blocks=64)))
        worker.start()
        streams = [worker.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
        long = worker.submit("long", [3] * 10, SamplingParams(max_tokens=500, ignore_eos=True))
        results = await asyncio.gather(*(_collect(s) for s in streams))
        assert [r[0] for r in results] == [o[0] for o in offline]
        worker.abort("long")
        got = await _collect(long)
        assert len(got[0]) < 500
        with pytest.raises(RequestError, match="prompt is empty"):
            await _collect(worker.submit("bad", [], params))
        in_use = await worker.call(lambda e: (e.check_integrity(), e.pool.stats().num_in_use)[1])
        assert in_use == 0
        await worker.stop()

    asyncio.run(main())


def test_n_samples_finishing_in_one_step_all_reach_the_stream(tiny_model_dir):
    loaded = load_model(tiny_model_dir)

    async def main() -> None:
        worker = EngineWorker(LLMEngine(loaded, EngineConfig(num_blocks=16)))
        worker.start()
        finished_seen: list[str] = []
        got = await _collect(worker.submit("n3", [4, 5, 6], SamplingParams(max_tokens=1, n=3, temperature=1.0, seed=1),
                                           on_finish=lambda e, rid: finished_seen.append(rid)))
        assert sorted(got) == [0, 1, 2] and all(len(v) == 1 for v in got.values())
        assert finished_seen == ["n3"]
        await worker.stop()

    asyncio.run(main())


def test_abort_before_the_fork_ends_every_sample(tiny_model_dir):
    loaded = load_model(tiny_model_dir)

    async def main() -> None:
        worker = EngineWorker(LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_batched_tokens=16)))
        worker.start()
        hooks: list[str] = []
        stream = worker.submit("n3", [7] * 200, SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=2),
                               on_finish=lambda e, rid: hooks.append(rid))
        worker.abort("n3")  # the 200-token prompt is still being prefilled in 16-token chunks
        reasons = [(o.index, o.finish_reason) async for o in stream]
        assert sorted(reasons) == [(0, "abort"), (1, "abort"), (2, "abort")]
        assert hooks == []  # an aborted request publishes nothing
        in_use = await worker.call(lambda e: (e.check_integrity(), e.pool.stats().num_in_use)[1])
        assert in_use == 0
        await worker.stop()

    asyncio.run(main())


def test_worker_on_the_callers_thread_serves_and_stops(tiny_model_dir):
    """The serving layout: the engine loop on the main thread, the event loop on another."""
    loaded = load_model(tiny_model_dir)
    prompt, params = [5, 6, 7, 8] * 5, SamplingParams(max_tokens=12, ignore_eos=True)
    [[offline]] = LLMEngine(loaded, EngineConfig(num_blocks=64)).generate([prompt], params)
    host = CallerThreadHost()
    worker = EngineWorker(LLMEngine(loaded, EngineConfig(num_blocks=64)), host=host)
    seen: dict[str, object] = {}

    async def main() -> None:
        worker.start()
        seen["tokens"] = (await _collect(worker.submit("r", prompt, params)))[0]
        seen["engine_thread"] = await worker.call(lambda e: threading.current_thread().name)
        await worker.stop()

    loop_thread = threading.Thread(target=lambda: asyncio.run(main()), name="event-loop")
    loop_thread.start()
    host.serve(keep_waiting=loop_thread.is_alive)
    loop_thread.join(30)
    assert seen == {"tokens": offline, "engine_thread": threading.main_thread().name}
    assert not loop_thread.is_alive()


def test_caller_thread_host_returns_when_nothing_comes():
    done = threading.Event()
    threading.Timer(0.2, done.set).start()
    CallerThreadHost().serve(keep_waiting=lambda: not done.is_set())
    assert done.is_set()


class _RecordingCores:
    """A `StepCores` that records the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_step(self) -> int:
        self.calls.append("before")
        return 1

    def after_step(self) -> None:
        self.calls.append("after")

    def idle(self) -> None:
        self.calls.append("idle")


def test_the_worker_brackets_every_step_with_its_cores_and_lends_them_when_idle(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    cores = _RecordingCores()
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main() -> None:
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
        worker = EngineWorker(engine, cores=cores)
        worker.start()
        assert len((await _collect(worker.submit("r", [5, 6, 7], params)))[0]) == 3
        await worker.stop()

    asyncio.run(main())
    calls = [c for i, c in enumerate(cores.calls) if c != "idle" or cores.calls[i - 1 : i] != ["idle"]]
    # idle before the request, then one before/after pair per step (prefill + 2 decodes), then idle again
    assert calls == ["idle", "before", "after", "before", "after", "before", "after", "idle"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash, on purpose
def test_a_dying_loop_fails_its_requests_and_refuses_everything_after(tiny_model_dir):
    """Issue 13: nothing waits forever on a dead engine loop: the requests in it end with the reason,
    and a request or call queued afterwards is refused at once with 503."""
    loaded = load_model(tiny_model_dir)

    async def main() -> None:
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
        steps = 0
        real_step = engine.step

        def step():
            nonlocal steps
            steps += 1
            if steps == 5:
                raise SystemExit("simulated crash")  # not an Exception: the step guard lets it through
            return real_step()

        engine.step = step
        worker = EngineWorker(engine)
        worker.start()
        stream = worker.submit("r1", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        got: list[int] = []
        with pytest.raises(EngineFailure) as err:
            async for out in stream:
                got.extend(out.new_token_ids)
        assert str(err.value) == "the engine loop died: SystemExit: simulated crash" and err.value.status == 503
        assert len(got) == 4  # one token per step before the fifth
        assert not worker.alive
        with pytest.raises(EngineFailure) as err:
            await _collect(worker.submit("r2", [5, 6, 7], SamplingParams(max_tokens=2)))
        assert err.value.status == 503
        assert str(err.value) == "the engine is not running (the engine loop died: SystemExit: simulated crash)"
        with pytest.raises(EngineFailure, match="the engine is not running"):
            await worker.call(lambda e: 1, timeout_s=5.0)
        await asyncio.to_thread(worker._thread.join, 10)  # its crash is reported here, where it is expected

    asyncio.run(main())


def test_cut_off_ends_running_requests_with_503_and_frees_their_blocks(tiny_model_dir):
    loaded = load_model(tiny_model_dir)

    async def main() -> None:
        worker = EngineWorker(LLMEngine(loaded, EngineConfig(num_blocks=64)))
        worker.start()
        streams = [worker.submit(f"r{i}", [5, 6, 7 + i], SamplingParams(max_tokens=2000, ignore_eos=True))
                   for i in range(2)]
        first = [await anext(aiter(s)) for s in streams]
        assert all(len(out.new_token_ids) == 1 for out in first)
        assert await worker.cut_off("node-0 is shutting down") == 2
        for s in streams:
            with pytest.raises(EngineFailure) as err:
                await _collect(s)
            assert str(err.value) == "node-0 is shutting down" and err.value.status == 503
        in_use = await worker.call(lambda e: (e.check_integrity(), e.pool.stats().num_in_use)[1])
        assert in_use == 0
        assert await _collect(worker.submit("after", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))) != {}
        await worker.stop()

    asyncio.run(main())


async def _wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_must_run_runs_after_its_caller_stopped_waiting_and_call_does_not(tiny_model_dir):
    """Issue 30 (5): a release queued behind a stuck engine thread runs once the thread is back, though its
    caller stopped waiting; a plain `call` (one that might take blocks) is skipped then. In queue order."""
    loaded = load_model(tiny_model_dir)

    async def main() -> None:
        worker = EngineWorker(LLMEngine(loaded, EngineConfig(num_blocks=16)))
        worker.start()
        blocks = await worker.call(lambda e: e.pool.allocate(2))
        assert worker.busy_for_s() == 0.0  # waiting for work: not busy
        stuck = threading.Event()
        hold = asyncio.ensure_future(worker.call(lambda e: stuck.wait(30), timeout_s=40))  # the thread is stuck
        await asyncio.sleep(0)
        ran: list[str] = []
        with pytest.raises(TimeoutError):
            await worker.call(lambda e: ran.append("call"), timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await worker.must_run(lambda e: (e.pool.release(blocks[:1]), ran.append("release 1")), timeout_s=0.2)
        cancelled = asyncio.ensure_future(worker.must_run(lambda e: (e.pool.release(blocks[1:]),
                                                                     ran.append("release 2"))))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        assert ran == [] and worker.busy_for_s() >= 0.2
        assert worker.alive  # slow is not dead: only the node's watchdog gives a stuck thread up
        stuck.set()
        assert await hold is True
        in_use = await worker.call(lambda e: (e.check_integrity(), e.pool.stats().num_in_use)[1])
        assert in_use == 0 and ran == ["release 1", "release 2"]
        await _wait_until(lambda: worker.busy_for_s() == 0.0)
        await worker.stop()

    asyncio.run(main())


def test_give_up_ends_every_request_with_503_and_a_thread_that_comes_back_frees_their_blocks(tiny_model_dir):
    """Issue 30 (1): the node's watchdog gives a stuck loop up: the request in the engine, the one queued and
    everything after end at once with the reason (503); the stuck thread, once back, frees their blocks and
    returns."""
    loaded = load_model(tiny_model_dir)

    async def main() -> None:
        engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
        real_step, steps = engine.step, [0]
        entered, stuck = threading.Event(), threading.Event()

        def step():
            steps[0] += 1
            if steps[0] == 3:
                entered.set()
                stuck.wait(30)
            return real_step()

        engine.step = step
        worker = EngineWorker(engine)
        worker.start()
        running = worker.submit("r1", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        assert await asyncio.to_thread(entered.wait, 10)
        queued = worker.submit("r2", [5, 6], SamplingParams(max_tokens=3))
        release = asyncio.ensure_future(worker.must_run(lambda e: 1))
        await asyncio.sleep(0.3)
        assert worker.alive and worker.busy_for_s() >= 0.3
        reason = "node-0's engine stalled"
        assert worker.give_up(reason) == 1
        assert not worker.alive and worker.stall_reason == reason
        for stream in (running, queued):
            with pytest.raises(EngineFailure) as err:
                await _collect(stream)
            assert str(err.value) == reason and err.value.status == 503
        with pytest.raises(EngineFailure, match=reason):
            await release
        with pytest.raises(EngineFailure, match=reason):
            await worker.call(lambda e: 1, timeout_s=5.0)
        with pytest.raises(EngineFailure, match=reason):
            await _collect(worker.submit("r3", [5, 6], SamplingParams(max_tokens=3)))
        stuck.set()
        assert await asyncio.to_thread(worker._stopped.wait, 10)  # the loop came back and returned
        engine.check_integrity()
        assert engine.pool.stats().num_in_use == 0
        assert steps[0] == 3  # no step after the one it was stuck in
        await worker.stop()

    asyncio.run(main())
