"""KV integrity through `kvrelay up` (issue 16): a prefill node damages the blocks it has just offered —
one flipped bit after the handle was given out, or every leased block overwritten as if the lease had
quietly ended and the slots were reused before the READ — and the decode node must catch it by the
handle's digests, count it at ``where="nixl_read"``, recompute and serve the reference tokens. With
``kvstore.integrity: off`` the same damage is served (the test can fail)."""

from __future__ import annotations

import random

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer

from tests.services.cluster import Cluster, get_json, metrics, publish_faults
from tests.services.test_faults import pools_idle, post, wait_for

PROMPT = [random.Random(16).randrange(256) for _ in range(100)]  # 6 full blocks + a 4-token tail
NUM_BLOCKS = 6


@pytest.fixture(scope="module")
def reference_text(tiny_model_dir) -> str:
    engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=64))
    [[want]] = engine.generate([PROMPT], SamplingParams(max_tokens=12))
    return load_tokenizer(tiny_model_dir).decode(want)


@pytest.mark.parametrize("fault, integrity, failures", [
    ("corrupt_published_block", "all", 1),
    ("overwrite_leased_blocks", "all", NUM_BLOCKS),
    ("corrupt_published_block", "off", 0),
    ("overwrite_leased_blocks", "off", 0),
])
def test_damaged_kv_read_over_nixl_is_recomputed_not_served(tiny_model_dir, reference_text, fault, integrity,
                                                            failures):
    overrides = {"kvstore": {"integrity": integrity}}
    with Cluster(tiny_model_dir, overrides=overrides, env=publish_faults(fault)) as c:
        code, out = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert code == 200, out
        m = metrics(c.decode_urls[0])
        assert m.get('kvrelay_kv_integrity_failures_total{where="nixl_read"}', 0.0) == failures
        assert m.get("kvrelay_kv_transfer_bytes_total", 0.0) > 0  # the blocks did travel over NIXL
        assert m.get('kvrelay_kv_integrity_checks_total{where="nixl_read"}', 0.0) == (
            NUM_BLOCKS if integrity == "all" else 0)
        wait_for(lambda: pools_idle(c), what="pools back to baseline")
    served_reference = out["choices"][0]["text"] == reference_text
    assert served_reference == (integrity == "all")  # off: the damaged KV was used


def held_keys(c: Cluster, url: str) -> set[bytes]:
    """The keys ``url``'s device pool holds now, from its KV events (stored, less removed)."""
    import urllib.request

    from kvrelay.transfer.config import TOKEN_HEADER
    from kvrelay.transfer.wire import unpack

    req = urllib.request.Request(url + "/kv/events?after=0", headers={TOKEN_HEADER: c.token})
    with urllib.request.urlopen(req, timeout=10) as resp:
        batch = unpack(resp.read())
    assert batch["events"] is not None, "the event log overflowed: read a snapshot instead"
    held: set[bytes] = set()
    for _, kind, key, _ in batch["events"]:
        (held.add if kind == "stored" else held.discard)(key)
    return held


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_handle_naming_another_prompt_s_blocks_is_refused_and_nothing_is_stored(tiny_model_dir, policy):
    """Issue 30, failure mode 4, under the default ``kvstore.integrity: sampled``: a handle for prompt A whose
    block ids are those of prompt B's blocks (leased by the same owner under another lease) — with no
    digests, or with A's own digests — is refused (``bad_handle``) before a byte is read: under ``fail`` the
    request ends with 502 and the decode node holds no block under A's keys; under ``recompute`` it serves
    A's reference tokens. A later honest request for A then reads A's blocks (``fail``: all of them)."""
    from kvrelay.transfer.wire import params_to_wire

    from tests.services.test_disagg import _internal_post, failure_reasons, transfer

    loaded = load_model(tiny_model_dir)
    block_bytes = LLMEngine.block_spec_for(loaded, 16).block_bytes
    rng = random.Random(30)
    prompts = [[rng.randrange(256) for _ in range(70)] for _ in range(4)]  # 4 full blocks each, and a tail
    engine = LLMEngine(loaded, EngineConfig(num_blocks=64))
    want = [engine.generate([p], SamplingParams(max_tokens=6))[0][0] for p in prompts]
    params = params_to_wire(SamplingParams(max_tokens=6))
    with Cluster(tiny_model_dir, overrides={"decode": {"on_transfer_failure": policy}}) as c:
        prefill, decode = c.prefill_urls[0], c.decode_urls[0]
        handles = []
        for i, p in enumerate(prompts):
            status, [pre] = _internal_post(prefill, "/prefill", {"request_id": f"p{i}", "prompt": p,
                                                                 "params": params, "salt": b""})
            assert status == 200 and pre["first_token_ids"] == want[i][:1] and len(pre["handle"]["digests"]) == 4
            handles.append(pre["handle"])
        variants = {  # A's handle, B's block ids; the digests as a forger might leave them
            "no digests": (0, 1, []),
            "A's own digests": (2, 3, handles[2]["digests"]),
        }
        for name, (a, b, digests) in variants.items():
            forged = {**handles[a], "tiers": handles[b]["tiers"], "block_ids": handles[b]["block_ids"],
                      "digests": digests}
            assert forged["block_ids"] != handles[a]["block_ids"]
            status, frames = _internal_post(decode, "/generate", {
                "request_id": f"forged-{a}", "prompt": prompts[a], "params": params, "salt": b"",
                "first_token_ids": want[a][:1], "handle": forged})
            if policy == "fail":
                assert status == 502, (name, frames)
                assert "KV transfer from the prefill node failed (bad_handle)" in frames[0]["error"], name
                assert ("carries no block digests" if not digests else "not what the owner leased") \
                    in frames[0]["error"], (name, frames[0]["error"])
                assert not held_keys(c, decode) & set(handles[a]["keys"]), name
            else:
                assert status == 200, (name, frames)
                assert want[a][:1] + [t for f in frames for t in f["tokens"]] == want[a], name
        assert failure_reasons(decode) == {"bad_handle": 2.0}
        assert transfer(decode)[0] == 0.0  # refused before any READ was posted
        wait_for(lambda: get_json(decode + "/health")["in_use_blocks"] == 0, what="decode pool idle")
        code, out = post(c.url, {"model": "tiny", "prompt": prompts[0], "max_tokens": 6, "temperature": 0})
        assert code == 200 and out["choices"][0]["text"] == load_tokenizer(tiny_model_dir).decode(want[0])
        assert transfer(decode)[0] == (4 * block_bytes if policy == "fail" else 0.0)  # recompute: held already


def test_sampled_integrity_catches_a_damaged_block_it_samples(tiny_model_dir, reference_text):
    """``kvstore.integrity: sampled`` (the default mode) end to end: each block a READ lands is checked
    with probability ``integrity_sample_rate``; at 1.0 every block is, so the one flipped bit of the last
    block is caught, counted, and the request recomputed to the reference text. (At the default 0.05 a
    damaged block goes unseen with probability 0.95: what ``sampled`` trades for speed.)"""
    overrides = {"kvstore": {"integrity": "sampled", "integrity_sample_rate": 1.0}}
    with Cluster(tiny_model_dir, overrides=overrides, env=publish_faults("corrupt_published_block")) as c:
        code, out = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert code == 200, out
        m = metrics(c.decode_urls[0])
        assert m.get('kvrelay_kv_integrity_checks_total{where="nixl_read"}', 0.0) == NUM_BLOCKS
        assert m.get('kvrelay_kv_integrity_failures_total{where="nixl_read"}', 0.0) == 1
        wait_for(lambda: pools_idle(c), what="pools back to baseline")
    assert out["choices"][0]["text"] == reference_text


def test_a_damaged_latent_block_of_a_deepseek_model_is_recomputed_not_served(tmp_path):
    """DeepSeek-V3's blocks (one latent row per token and layer) under the same damage as above: the flipped
    bit is caught by the handle's digest over the latent bytes, counted, and the prompt recomputed."""
    from kvrelay.model.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "ds", arch="deepseek-v3", layers=4)
    engine = LLMEngine(load_model(model_dir), EngineConfig(num_blocks=64))
    [[want]] = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    block_bytes = LLMEngine.block_spec_for(load_model(model_dir), 16).block_bytes
    overrides = {"kvstore": {"integrity": "all"}}
    with Cluster(model_dir, overrides=overrides, env=publish_faults("corrupt_published_block")) as c:
        code, out = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                 "ignore_eos": True})
        assert code == 200, out
        m = metrics(c.decode_urls[0])
        assert m.get('kvrelay_kv_integrity_failures_total{where="nixl_read"}', 0.0) == 1
        assert m.get('kvrelay_kv_integrity_checks_total{where="nixl_read"}', 0.0) == NUM_BLOCKS
        assert m.get("kvrelay_kv_transfer_bytes_total", 0.0) == NUM_BLOCKS * block_bytes  # latent-sized blocks
        wait_for(lambda: pools_idle(c), what="pools back to baseline")
    assert out["choices"][0]["text"] == load_tokenizer(model_dir).decode(want)
