"""Issue 28: the router's queue and its capacity ledger, without a network (real NodeSet, no nodes)."""

from __future__ import annotations

import asyncio

import pytest
from kvrelay.model.sampling_params import SamplingParams
from kvrelay.router.node_state import NodeCapacity
from kvrelay.router.nodes import Need, NodeSet
from kvrelay.router.openai_api import GenerationRequest
from kvrelay.router.queue import Overloaded, QueueConfig, RouterQueue, need_of

B = 16


def request(prompt_tokens: int, max_tokens: int = 16, n: int = 1, rid: str = "r") -> GenerationRequest:
    return GenerationRequest(rid, "completion", list(range(1, prompt_tokens + 1)),
                             SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0), (),
                             False, False, 0)


def capacity(kv_blocks: int, *, max_num_seqs: int = 64, tokens: int = 512, prefill_rate: float = 0.0,
             decode_step_s: float = 0.0) -> NodeCapacity:
    return NodeCapacity(kv_blocks, kv_blocks, max_num_seqs, tokens, prefill_rate, decode_step_s)


def nodes(prefill: int = 1, decode: int = 1) -> NodeSet:
    return NodeSet([f"http://p{i}" for i in range(prefill)], [f"http://d{i}" for i in range(decode)],
                   block_size_tokens=B)


def test_need_counts_shared_prompt_blocks_once_and_a_tail_per_sample():
    # 40 tokens: 2 full blocks + 8; one sample keeps 16 output tokens: 8 + 16 = 24 -> 2 tail blocks
    assert need_of(request(40, 16), block_size_tokens=B, decode_reserve_tokens=256) == Need(40, 3, 4, 1, 16)
    # n=3: each sample's tail (8 + 1 first token, 8 + 16 kept) is its own
    assert need_of(request(40, 16, n=3), block_size_tokens=B, decode_reserve_tokens=256) == Need(40, 5, 8, 3, 16)
    # output beyond decode_reserve_tokens is not reserved (the node preempts beyond it)
    assert need_of(request(32, 1000), block_size_tokens=B, decode_reserve_tokens=64) == Need(32, 3, 6, 1, 64)


def test_place_reserves_decode_and_prefill_room_and_gives_it_back_step_by_step():
    ns = nodes()
    p, d = ns.prefill[0], ns.decode[0]
    p.capacity, d.capacity = capacity(10, tokens=64), capacity(10, max_num_seqs=2)
    need = Need(prompt_tokens=100, prefill_blocks=7, decode_blocks=6, seqs=1)
    first = ns.place(need, [])
    assert first is not None and (first.prefill, first.decode) == (p, d)
    assert (p.reserved_blocks, p.queued_tokens, d.reserved_blocks, d.reserved_seqs) == (7, 100, 6, 1)
    assert ns.place(need, []) is None  # 6 + 6 > 10 decode blocks
    first.prefilled()
    first.prefilled()  # idempotent
    assert (p.reserved_blocks, p.queued_tokens) == (7, 0)
    first.pulled()
    assert p.reserved_blocks == 0
    assert ns.place(need, []) is None  # the decode node still holds the first request
    first.release()
    first.release()
    assert (p.reserved_blocks, p.queued_tokens, d.reserved_blocks, d.reserved_seqs) == (0, 0, 0, 0)
    # A node with nothing reserved always takes one request, even one larger than it.
    huge = ns.place(Need(5000, 400, 400, 1), [])
    assert huge is not None and d.reserved_blocks == 400
    huge.release()
    # The prefill queue bound: 4 steps of the node's token budget.
    a = ns.place(Need(200, 1, 1, 1), [])
    assert a is not None and ns.place(Need(57, 1, 1, 1), []) is None  # 200 + 57 > 4 * 64
    assert ns.place(Need(56, 1, 1, 1), []) is not None


def test_decode_sequences_are_bounded_by_twice_the_batch_and_unreported_nodes_by_nothing():
    ns = nodes(prefill=0)
    d = ns.decode[0]
    need = Need(10, 1, 1, 1)
    held = [ns.place(need, []) for _ in range(6)]
    assert all(r is not None and r.prefill is None for r in held)  # no report yet: not bounded
    d.capacity = capacity(100, max_num_seqs=3)  # 3 in the batch, 3 more prefilling or waiting with their KV
    assert ns.place(need, []) is None
    held[0].release()
    assert ns.place(need, []) is not None


async def _queue(ns: NodeSet, **config: object) -> RouterQueue:
    return RouterQueue(ns, QueueConfig(**config))


def test_tickets_are_placed_first_come_first_served_and_the_head_is_not_overtaken():
    async def main() -> None:
        ns = nodes(prefill=0)
        ns.decode[0].capacity = capacity(10)
        q = await _queue(ns)
        big, small, small2 = request(140, 16, rid="big"), request(10, rid="s1"), request(10, rid="s2")
        [t_hold] = q.admit([request(100, rid="hold")], [[]], b"")
        hold = await q.place(t_hold)  # 7 blocks of 10
        [t_big] = q.admit([big], [[]], b"")  # 10 blocks: waits
        [t_s1] = q.admit([small], [[]], b"")  # 2 blocks would fit, but the head waits first
        [t_s2] = q.admit([small2], [[]], b"")
        assert (t_big.placed.done(), t_s1.placed.done(), q.num_queued) == (False, False, 3)
        q.finish(t_hold, hold, 16)
        got = await q.place(t_big)
        assert got.need.decode_blocks == 10 and not t_s1.placed.done()
        q.finish(t_big, got, 16)
        assert t_s1.placed.done() and t_s2.placed.done() and q.num_queued == 0

    asyncio.run(main())


def test_turns_go_round_robin_over_tenants():
    async def main() -> None:
        ns = nodes(prefill=0)
        ns.decode[0].capacity = capacity(2)  # one request(4) at a time
        q = await _queue(ns)
        [t0] = q.admit([request(4, rid="a0")], [[]], b"A")
        held = await q.place(t0)
        tickets = [q.admit([request(4, rid=f"{t}{i}")], [[]], t.encode())[0]
                   for t, i in (("A", 1), ("A", 2), ("A", 3), ("B", 1), ("B", 2), ("C", 1))]
        order = []
        for _ in tickets:
            done = [t for t in tickets if t.placed.done() and t not in order]
            assert not done
            q.finish(t0, held, 1)
            [t0] = [t for t in tickets if t.placed.done() and t not in order]
            held = t0.placed.result()
            order.append(t0)
        # each tenant in turn, oldest first within one: A1 B1 C1 A2 B2 A3
        assert [tickets.index(t) for t in order] == [0, 3, 5, 1, 4, 2]

    asyncio.run(main())


def test_a_full_queue_gives_a_light_tenant_the_place_of_the_heaviest_one_s_newest_request():
    async def main() -> None:
        ns = nodes(prefill=0)
        ns.decode[0].capacity = capacity(2)  # one request(4) at a time
        q = await _queue(ns, max_requests=4)
        [t0] = q.admit([request(4)], [[]], b"A")
        await q.place(t0)
        a = [q.admit([request(4)], [[]], b"A")[0] for _ in range(4)]
        [b] = q.admit([request(4)], [[]], b"B")  # B holds 0 < 4 // 2: A's newest goes
        with pytest.raises(Overloaded) as err:
            await q.place(a[-1])
        assert (err.value.reason, err.value.status) == ("fair_share", 429)
        assert q.num_queued == 4 and not b.placed.done()
        with pytest.raises(Overloaded) as err:  # A holds 3 > its share of 2 now
            q.admit([request(4)], [[]], b"A")
        assert err.value.reason == "queue_full" and "router.max_queued_requests 4" in err.value.message
        assert err.value.retry_after_s == 1  # nothing measured: no predicted wait
        assert q.num_queued == 4

    asyncio.run(main())


def test_predicted_wait_comes_from_reported_rates_and_refuses_beyond_the_deadline():
    async def main() -> None:
        ns = nodes(prefill=1)
        ns.prefill[0].capacity = capacity(1000, prefill_rate=100.0)
        # 10 slots (max_num_seqs) at 0.1 s a step: 100 tokens/s of decode
        ns.decode[0].capacity = capacity(1000, max_num_seqs=10, decode_step_s=0.1)
        q = await _queue(ns, timeout_s=5.0)
        ns.decode[0].reserved_seqs = 20  # busy (twice its batch of 10): everything queues
        ns.decode[0].reserved_blocks = 1
        q.admit([request(200, max_tokens=100)], [[]], b"")  # ahead: 200 prompt tokens, 100 output tokens
        assert q.predicted_wait_s() == pytest.approx(2.0)  # max(200 / 100, 100 / 100): in parallel
        q.admit([request(300, max_tokens=300)], [[]], b"")
        assert q.predicted_wait_s() == pytest.approx(5.0)  # 500 / 100 prefill, 400 / 100 decode
        q.admit([request(10, max_tokens=10)], [[]], b"")  # predicted 5.0 s: not beyond 5 s
        with pytest.raises(Overloaded) as err:
            q.admit([request(10)], [[]], b"")  # 5.1 s
        assert (err.value.reason, err.value.retry_after_s) == ("predicted_wait", 1)
        assert "router.queue_timeout_s" in err.value.message and q.num_queued == 3

    asyncio.run(main())


def test_aggregated_prediction_adds_prefill_and_decode_time_of_the_decode_nodes():
    async def main() -> None:
        ns = nodes(prefill=0)
        ns.decode[0].capacity = capacity(1000, max_num_seqs=10, prefill_rate=100.0, decode_step_s=0.1)
        ns.decode[0].reserved_seqs = 20
        ns.decode[0].reserved_blocks = 1
        q = await _queue(ns)
        q.admit([request(200, max_tokens=100)], [[]], b"")
        assert q.predicted_wait_s() == pytest.approx(3.0)  # 2 s of prefill, then 1 s of decode, one node

    asyncio.run(main())


def test_a_ticket_that_waits_past_its_deadline_gets_429_and_leaves_the_queue():
    async def main() -> None:
        ns = nodes(prefill=0)
        ns.decode[0].capacity = capacity(2)
        q = await _queue(ns, timeout_s=0.2)
        [t0] = q.admit([request(4)], [[]], b"")
        await q.place(t0)
        [t1] = q.admit([request(4)], [[]], b"")
        with pytest.raises(Overloaded) as err:
            await q.place(t1)
        assert err.value.reason == "deadline" and q.num_queued == 0

    asyncio.run(main())


def test_a_waiter_that_goes_away_leaves_and_a_placed_one_gives_its_room_back():
    async def main() -> None:
        ns = nodes(prefill=0)
        d = ns.decode[0]
        d.capacity = capacity(2)
        q = await _queue(ns)
        [t0] = q.admit([request(4)], [[]], b"")
        r0 = await q.place(t0)
        [t1] = q.admit([request(4)], [[]], b"")
        waiter = asyncio.ensure_future(q.place(t1))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert q.num_queued == 0
        q.finish(t0, r0, 1)
        assert (d.reserved_seqs, d.reserved_blocks) == (0, 0)
        [t2] = q.admit([request(4)], [[]], b"")
        assert t2.placed.done() and d.reserved_seqs == 1
        q.abandon(t2)  # placed, then its request ended before it ran
        assert (d.reserved_seqs, d.reserved_blocks) == (0, 0)

    asyncio.run(main())


def test_a_load_report_becomes_a_capacity_or_is_refused_by_name():
    report = {"kv_blocks": 182, "free_blocks": 170, "max_num_seqs": 64, "max_num_batched_tokens": 1024,
              "prefill_tokens_per_s": 950.5, "decode_step_s": 0.09}
    assert NodeCapacity.from_report(report) == NodeCapacity(182, 170, 64, 1024, 950.5, 0.09)
    with pytest.raises(ValueError, match="malformed load report: KeyError\\('kv_blocks'"):
        NodeCapacity.from_report({k: v for k, v in report.items() if k != "kv_blocks"})
    with pytest.raises(ValueError, match="load report out of range"):
        NodeCapacity.from_report({**report, "kv_blocks": 0})
    with pytest.raises(ValueError, match="load report out of range"):
        NodeCapacity.from_report({**report, "decode_step_s": float("nan")})
    steps = {"step_fixed_s": 0.01, "step_prefill_token_s": 0.001, "step_decode_row_s": 0.002}
    assert NodeCapacity.from_report({**report, **steps}) == NodeCapacity(
        182, 170, 64, 1024, 950.5, 0.09, step_fixed_s=0.01, step_prefill_token_s=0.001, step_decode_row_s=0.002)
    with pytest.raises(ValueError, match="load report out of range"):
        NodeCapacity.from_report({**report, **steps, "step_decode_row_s": -0.002})


def test_a_queued_request_counts_its_prompt_as_held_and_the_prompt_is_held_compactly():
    """Issue 65 item 6: 4 bytes a prompt token (array('I'), not a list of ints) and 73 a block key."""
    from array import array

    from kvrelay.router.queue import compact

    async def main() -> None:
        ns = nodes(prefill=0)
        ns.decode[0].capacity = capacity(10)
        q = await _queue(ns)
        keys = [bytes([i]) * 32 for i in range(6)]
        [t] = q.admit([request(100)], [keys], b"")
        assert t.num_bytes == 100 * 4 + 6 * 73
        req = compact(request(3))
        assert isinstance(req.prompt_token_ids, array) and req.prompt_token_ids.itemsize == 4
        assert list(req.prompt_token_ids) == [1, 2, 3]
        with pytest.raises(OverflowError):
            compact(GenerationRequest("r", "completion", [2**32], SamplingParams(max_tokens=1), (), False, False, 0))

    asyncio.run(main())
