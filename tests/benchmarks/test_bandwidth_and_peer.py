"""Pieces of the real-model benchmarks: weight bytes per token, dtype agreement, and the peer server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvrelay.benchmarks.bandwidth_bench import (
    NEAR_ROUND_TRIP_NS,
    compare_rounds,
    decode_rounds,
    placement,
    round_trip_ns,
    weight_bytes,
)
from kvrelay.benchmarks.dtype_bench import run as dtype_run
from kvrelay.benchmarks.peer import PeerServer
from kvrelay.kernels.cpu_small import load as load_kernels
from kvrelay.model.loader import load_model


def test_weight_bytes_counts_a_tied_embedding_once(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h  # q, o, k, v, gate/up/down, two norms
    head = 0 if config.get("tie_word_embeddings") else vocab * h
    want = 4 * (vocab * h + config["num_hidden_layers"] * per_layer + h + head)  # float32
    assert weight_bytes(load_model(tiny_model_dir, dtype="float32").model) == want


def test_a_round_pairs_each_decode_step_with_a_read_and_keeps_the_peak_bound(tiny_model_dir: Path) -> None:
    out = decode_rounds(str(tiny_model_dir), dtype="float32", prompt_tokens=8, new_tokens=4, rounds=1)
    (r,) = out["rounds"]
    assert r["steps"] == 3  # every token after the first is one paired step
    assert r["step_ms_median"] == 1e3 / r["decode_tok_s"] and r["fraction_of_limit"] > 0
    assert r["read_bytes_per_s"] == max(r["read_before_bytes_per_s"], r["read_after_bytes_per_s"]) > 0
    assert r["peak_limit_tok_s"] == r["read_bytes_per_s"] / out["weight_bytes"]
    assert r["fraction_of_peak_limit"] == r["decode_tok_s"] / r["peak_limit_tok_s"]
    assert out["fraction_of_limit"] == r["fraction_of_limit"] and out["dtype"] == "float32"
    assert r["one_thread_read_bytes_per_s"] > 0
    # this machine has two CPUs and the compiled extension: each round records the threads' round trips
    assert r["round_trip_ns_before"] > 0 and r["round_trip_ns_after"] > 0
    assert r["placement"] == placement(r["round_trip_ns_before"], r["round_trip_ns_after"])
    assert out["fraction_of_limit_by_placement"] == {r["placement"]: r["fraction_of_limit"]}


def test_a_round_is_placed_by_its_two_round_trips() -> None:
    near, far = NEAR_ROUND_TRIP_NS - 1, NEAR_ROUND_TRIP_NS + 1
    assert placement(near, near) == "near" and placement(far, far) == "far"
    assert placement(near, far) == "changed" and placement(far, near) == "changed"
    assert placement(None, near) is None and placement(far, None) is None


def test_the_round_trip_probe_runs_on_a_team_of_two_and_refuses_no_trips() -> None:
    ext = load_kernels()
    assert ext is not None  # the CPU kernels build on every machine this runs on
    ns = ext.thread_round_trip_ns(1000)
    # a cache line's trip (~60-340 ns here; a few µs with a descheduled vCPU), not ~0.8 ms of two threads taking
    # turns on one CPU
    assert 0 < ns < 1e5
    with pytest.raises(RuntimeError, match="trips must be at least 1, got 0"):
        ext.thread_round_trip_ns(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert round_trip_ns(100) is None  # one torch thread: no team of two to measure
    finally:
        torch.set_num_threads(threads)


def test_a_decode_of_one_token_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="new_tokens must be at least 2"):
        decode_rounds(str(tiny_model_dir), dtype="float32", prompt_tokens=8, new_tokens=1, rounds=1)


@pytest.mark.parametrize("compare", ["one-call", "balance"])
def test_a_comparison_alternates_the_two_paths_step_by_step(compare: str, tiny_model_dir: Path) -> None:
    out = compare_rounds(str(tiny_model_dir), dtype="bfloat16", prompt_tokens=8, new_tokens=6, rounds=2,
                         compare=compare)
    assert out["compare"] == compare and len(out["rounds"]) == 2
    for r in out["rounds"]:
        assert r["steps"] == 5  # every token after the first, the two paths in turn
        assert r["new_over_old"] == r["step_ms_new"] / r["step_ms_old"]
        assert r["fraction_old"] > 0 and r["fraction_new"] > 0
    a, b = (r["new_over_old"] for r in out["rounds"])
    assert out["new_over_old_median"] == (a + b) / 2  # the median of two rounds


def test_a_comparison_is_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="compare must be one of one-call, balance, got 'fast'"):
        compare_rounds(str(tiny_model_dir), dtype="bfloat16", prompt_tokens=8, new_tokens=6, rounds=1, compare="fast")
    with pytest.raises(ValueError, match="new_tokens must be at least 3"):
        compare_rounds(str(tiny_model_dir), dtype="bfloat16", prompt_tokens=8, new_tokens=2, rounds=1,
                       compare="balance")
    with pytest.raises(ValueError, match="this model has no one-call decode"):
        compare_rounds(str(tiny_model_dir), dtype="float16", prompt_tokens=8, new_tokens=4, rounds=1,
                       compare="one-call")


def test_dtype_agreement_is_reported_as_fractions(tiny_model_dir: Path) -> None:
    out = dtype_run(str(tiny_model_dir), count=3, new_tokens=4)
    assert out["prompts"] == 3 and out["new_tokens"] == 4
    assert out["identical_outputs_frac"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert out["mean_agreeing_prefix_frac"] <= out["mean_positional_agreement"]


def test_a_peer_that_exits_is_reported_with_its_output(tmp_path: Path) -> None:
    script = tmp_path / "peer.sh"
    script.write_text('echo "peer cannot serve $2 on port $3" >&2; exit 3\n')
    with pytest.raises(RuntimeError) as err:
        PeerServer(script, tmp_path).start(timeout_s=30)
    assert str(err.value).startswith("peer peer.sh exited with code 3:\npeer cannot serve ")
    with pytest.raises(FileNotFoundError, match="pass --peer-script"):
        PeerServer(tmp_path / "absent.sh", tmp_path)
