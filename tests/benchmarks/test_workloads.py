"""`benchmarks.workloads`: shapes, determinism and the trace scaling rules."""

from __future__ import annotations

import json

import pytest
from kvrelay.benchmarks import workloads
from kvrelay.benchmarks.offline_cache import ideal_hit_blocks
from kvrelay.benchmarks.serve_client import RequestRecord, RequestSpec


def test_shared_prefix_shape_and_ideal_hit_rate():
    w = workloads.shared_prefix(groups=3, prompts_per_group=4, system_tokens=64, question_tokens=8,
                                output_tokens=5, seed=7)
    assert len(w.requests) == 12 and w.expected_total == 12
    assert all(len(s.prompt_token_ids) == 72 and s.max_tokens == 5 for s in w.requests)
    systems = {s.prompt_token_ids[:64] for s in w.requests}
    assert len(systems) == 3
    assert w.requests == workloads.shared_prefix(groups=3, prompts_per_group=4, system_tokens=64,
                                                 question_tokens=8, output_tokens=5, seed=7).requests
    # block 16: each prompt looks up (72 - 1) // 16 = 4 blocks, all system-prompt blocks; first of a group misses
    records = [RequestRecord(s) for s in w.requests]
    replay = w.cached_requests(records, replies_cached=True)
    assert ideal_hit_blocks(replay, block_size_tokens=16).hit_rate == pytest.approx(9 / 12)


def test_multi_round_grows_by_the_reply():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    w = workloads.multi_round(users=2, rounds=3, system_tokens=10, question_tokens=4, output_tokens=3,
                              encode=encode, max_prompt_tokens=40, seed=1)
    assert len(w.requests) == 2 and w.expected_total == 6
    first = w.requests[0]
    assert first.prompt_token_ids[:10] == w.requests[1].prompt_token_ids[:10]  # shared system prompt
    rec = RequestRecord(first, generated_text="xyz", success=True)
    second = w.follow_up(first, rec)
    assert second is not None and second.turn == 1 and second.conversation == first.conversation
    assert second.prompt_token_ids[:14] == first.prompt_token_ids
    assert second.prompt_token_ids[14:17] == (120, 121, 122)
    assert len(second.prompt_token_ids) == 21
    third = w.follow_up(second, RequestRecord(second, generated_text="x" * 20, success=True))
    assert third is None  # 21 + 20 + 4 tokens would pass max_prompt_tokens
    assert w.follow_up(RequestSpec((1,), 1, turn=2), rec) is None  # rounds exhausted
    # a decode node computed the reply: the ideal replay sees it; a prefill node never did
    [with_reply] = w.cached_requests([rec], replies_cached=True)
    assert with_reply.computed_token_ids == first.prompt_token_ids + (120, 121, 122)
    assert w.cached_requests([rec], replies_cached=False)[0].computed_token_ids is None


@pytest.fixture
def trace_file(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 1000, "output_length": 100, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [0, 2]},
        {"timestamp": 4000, "input_length": 1500, "output_length": 2000, "hash_ids": [0, 1, 3]},
        {"timestamp": 7000, "input_length": 512, "output_length": 20, "hash_ids": [4]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trace_scaling_window_and_time(trace_file):
    w = workloads.trace(path=trace_file, start=0, num_requests=3, block_tokens=16, time_compression=2.0,
                        max_prompt_tokens=40, max_output_tokens=32)
    lengths = [len(s.prompt_token_ids) for s in w.requests]
    assert lengths == [32, 22, 40]  # ceil(1000/32), ceil(700/32), ceil(1500/32) = 47 cut to 40
    assert [s.max_tokens for s in w.requests] == [3, 1, 32]  # round(100/32), max(1, round(5/32)), clamp(62)
    assert [s.arrival_s for s in w.requests] == [0.0, 0.0, 1.5]  # (4000 - 1000) ms / 1000 / 2
    a, b, c = (s.prompt_token_ids for s in w.requests)
    assert a[:16] == b[:16] == c[:16]  # hash id 0
    assert a[16:32] == c[16:32] and a[16:32] != b[16:32]  # hash 1 vs 2
    assert w.params["prompts_cut"] == 1 and w.params["length_scale"] == "512 trace tokens -> 16"
    again = workloads.trace(path=trace_file, start=1, num_requests=2, block_tokens=16, max_prompt_tokens=40)
    assert again.requests[0].prompt_token_ids == b  # same hash id → same tokens, whatever the window
    assert again.requests[0].arrival_s == 0.0 and again.requests[1].arrival_s == 3.0
    with pytest.raises(ValueError, match="empty"):
        workloads.trace(path=trace_file, start=10, num_requests=2)


def test_random_prompts_lengths():
    w = workloads.random_prompts(num_requests=20, input_tokens=100, output_tokens=4, range_ratio=0.5, seed=3)
    lengths = [len(s.prompt_token_ids) for s in w.requests]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 1
    assert all(0 <= t < 256 for s in w.requests for t in s.prompt_token_ids)
