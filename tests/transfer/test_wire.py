"""Issue 4, test 5 (decoders): malformed metadata, handles, lease messages and router ↔ node messages
are rejected with one typed `WireError`; memory stays bounded; a pickle payload is never executed."""

from __future__ import annotations

import dataclasses
import pickle
import resource
from pathlib import Path

import msgpack
import pytest
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.model.sampling_params import PromptTokenLogprobs, SamplingParams
from kvrelay.transfer import wire as wire_module
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.lease import TierBlock
from kvrelay.transfer.metadata import PROTOCOL_VERSION, AgentMeta, TierRegion
from kvrelay.transfer.wire import (
    MAX_SALT_BYTES,
    DecodeFrame,
    GenerationMessage,
    PrefillReply,
    StreamError,
    WireError,
    WireVersionError,
    decode_frame,
    decode_generation,
    decode_handle,
    decode_lease_request,
    decode_meta,
    decode_notif,
    decode_prefill_reply,
    decode_renew_reply,
    encode_error_frame,
    encode_frame,
    encode_generation,
    encode_handle,
    encode_meta,
    encode_notif,
    encode_prefill_reply,
    handle_from_wire,
    handle_to_wire,
    prompt_logprob_values,
)

HANDLE = KvHandle("prefill-0", "ab12", "http://127.0.0.1:8101", (BlockKey(b"\x01" * 32), BlockKey(b"\x02" * 32)),
                  (TierBlock("device", 7), TierBlock("host", 3)), 32, "c0ffee", 30.0)
META = AgentMeta(PROTOCOL_VERSION, "prefill-0", "ab12", b"nixl-md", b"\x07" * 32,
                 (TierRegion("device", "DRAM", 0, 0x7F0000000000, 131072, 131072, 640),))


class MarkerPickle:
    """Unpickling this creates ``path`` — proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def malformed(tmp_path: Path) -> dict[str, bytes]:
    good = encode_handle(HANDLE)
    return {
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "bin 4 GiB declared": b"\x81\xa4keys\x91\xc6\xff\xff\xff\xff" + b"\x00" * 16,
        "str 4 GiB declared": b"\x81\xa1v\xdb\xff\xff\xff\xff" + b"x" * 16,
        "array 4 GiB declared": b"\x81\xa4keys\xdd\xff\xff\xff\xff",
        "map 4 GiB declared": b"\xdf\xff\xff\xff\xff",
        "deep nesting": b"\x91" * 100_000 + b"\xc0",
        "nested maps": b"\x81\xa1v" * 5000 + b"\x01",
        "not a map": msgpack.packb([1, 2, 3]),
        "ext type": b"\xd4\x01\x00",
        "int keys": msgpack.packb({1: 2}),
        "extra data": good + b"\x00",
        "pickle": pickle.dumps(MarkerPickle(tmp_path / "pwned")),
        "oversized": msgpack.packb({"v": 1, "pad": b"x" * (9 << 20)}),
    }


@pytest.mark.parametrize("decoder", [decode_meta, decode_handle, decode_notif, decode_lease_request,
                                     decode_renew_reply, decode_generation, decode_prefill_reply])
def test_malformed_payloads_are_rejected_with_bounded_memory_and_no_pickle(decoder, tmp_path):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, payload in malformed(tmp_path).items():
        with pytest.raises(WireError):
            decoder(payload)
        assert not (tmp_path / "pwned").exists(), name
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 * 1024  # KiB: no 4 GiB buffer


def wire(**changes):
    msg = handle_to_wire(HANDLE)
    msg.update(changes)
    return msg


@pytest.mark.parametrize("msg, match", [
    (wire(keys="nope"), "keys: expected list"),
    (wire(keys=[b"\x01" * 31, b"\x02" * 32]), r"keys\[0\]: expected 32 bytes"),
    (wire(keys=[b"\x01" * 32, b"\x01" * 32]), "listed twice"),
    (wire(keys=[]), "outside"),
    (wire(block_ids=[7]), "2 keys but 2 tiers and 1 block ids"),
    (wire(block_ids=[7, -1]), r"block_ids\[1\]"),
    (wire(block_ids=[7, True]), r"block_ids\[1\]"),
    (wire(block_ids=[7, 2**40]), r"block_ids\[1\]"),
    (wire(tiers=["device", 3]), r"tiers\[1\]"),
    (wire(num_tokens="32"), "num_tokens: expected int"),
    (wire(num_tokens=0), "num_tokens"),
    (wire(lease_ttl_s=float("nan")), "lease_ttl_s"),
    (wire(lease_ttl_s=-1), "lease_ttl_s"),
    (wire(lease_id=""), "lease_id"),
    (wire(digests=[1]), r"digests: expected an empty list or one digest per key \(2\)"),
    (wire(digests=[1, 2**64]), r"digests\[1\]: expected an int in \[0, 2\*\*64\)"),
    (wire(digests=[1, -1]), r"digests\[1\]"),
    (wire(digests=[True, 2]), r"digests\[0\]"),
    (wire(digests="ab"), "digests: expected an empty list"),
    (wire(lease_id="x" * 65), "lease_id"),
    (wire(owner_url="file:///etc/passwd"), "not an http"),
    (wire(owner_agent=None), "owner_agent: expected str"),
    (wire(v="1"), "v: expected int"),
    ({"keys": []}, "v: missing"),
    ("a string", "expected a map"),
])
def test_handle_schema_violations_name_the_field(msg, match):
    with pytest.raises(WireError, match=match):
        handle_from_wire(msg)


def test_round_trips_and_version_mismatch():
    assert decode_handle(encode_handle(HANDLE)) == HANDLE
    with_digests = dataclasses.replace(HANDLE, digests=(0, 2**64 - 1))
    assert decode_handle(encode_handle(with_digests)) == with_digests
    old = handle_to_wire(HANDLE)
    del old["digests"]  # from an owner that predates digests: no check
    assert handle_from_wire(old).digests == ()
    assert decode_meta(encode_meta(META)) == META
    assert decode_notif(encode_notif("done", "c0ffee")).lease_id == "c0ffee"
    newer = PROTOCOL_VERSION + 1
    with pytest.raises(WireVersionError, match=f"protocol version {newer}, this node speaks {PROTOCOL_VERSION}"):
        handle_from_wire(wire(v=newer))


@pytest.mark.parametrize("tier, match", [
    ({"mem": "HBM"}, "not DRAM or VRAM"),
    ({"num_blocks": 0}, "num_blocks"),
    ({"stride": 1}, "stride"),
    ({"base": 2**64 - 4096}, "past the end"),
    ({"name": 7}, "name: expected str"),
])
def test_meta_schema_violations_name_the_field(tier, match):
    raw = msgpack.unpackb(encode_meta(META))
    raw["tiers"][0].update(tier)
    with pytest.raises(WireError, match=match):
        decode_meta(msgpack.packb(raw))
    raw = msgpack.unpackb(encode_meta(META))
    raw["fingerprint"] = b"short"
    with pytest.raises(WireError, match="fingerprint: 5 bytes"):
        decode_meta(msgpack.packb(raw))


GEN = GenerationMessage("r1", [1, 2, 3], SamplingParams(
    max_tokens=5, temperature=0.5, stop_token_ids=(7,), presence_penalty=0.5, frequency_penalty=-1.0,
    repetition_penalty=1.25, min_p=0.1, min_tokens=2, logit_bias=((4, -100.0), (9, 2.5))), b"s" * 16,
    first_token_ids=[9], handle=HANDLE, long_context={"policy": "h2o"})


def gen_wire(**changes):
    msg = msgpack.unpackb(encode_generation(GEN), raw=False)
    msg.update(changes)
    return msgpack.packb(msg, use_bin_type=True)


def test_router_node_messages_round_trip_typed():
    assert decode_generation(encode_generation(GEN)) == GEN
    bare = GenerationMessage("r2", [5], SamplingParams(), b"")
    assert decode_generation(encode_generation(bare)) == bare
    moved = GenerationMessage("r3", [5, 6], SamplingParams(n=3), b"", resume_token_ids=[[7, 8], None, []])
    assert decode_generation(encode_generation(moved)) == moved
    reply = PrefillReply([4, 5], ["stop", None], HANDLE, 16)
    assert decode_prefill_reply(encode_prefill_reply(reply)) == reply
    frame = DecodeFrame(1, [3, 4], True, "length")
    assert decode_frame(msgpack.unpackb(encode_frame(frame), raw=False)) == frame
    with pytest.raises(StreamError, match="engine broke") as err:
        decode_frame(msgpack.unpackb(encode_error_frame("engine broke", 503), raw=False))
    assert err.value.status == 503


def test_a_malformed_handle_in_a_prefill_reply_still_names_its_lease_for_release():
    """Issue 28: the router releases the lease of a handle nobody can pull, by the id it can still read."""
    bad = dataclasses.replace(HANDLE, num_tokens=0)
    reply = decode_prefill_reply(encode_prefill_reply(PrefillReply([4], [None], bad, 0)))
    assert (reply.handle, reply.lease_id) == (None, HANDLE.lease_id) and "num_tokens" in reply.handle_error
    wire = msgpack.unpackb(encode_prefill_reply(PrefillReply([4], [None], bad, 0)), raw=False)
    wire["handle"]["lease_id"] = 7  # not even the id is readable: nothing to release by
    reply = decode_prefill_reply(msgpack.packb(wire, use_bin_type=True))
    assert (reply.handle, reply.lease_id) == (None, None)


def test_a_malformed_handle_in_a_request_is_reported_not_fatal():
    msg = decode_generation(gen_wire(handle={"v": 999}))
    assert msg.handle is None and "protocol version 999" in msg.handle_error
    assert msg.prompt == GEN.prompt  # the request itself stands: decode counts bad_handle and recomputes


@pytest.mark.parametrize("changes, match", [
    ({"prompt": [1, -1]}, r"generation request.prompt: must be a list of token ids"),
    ({"prompt": [2**32]}, "prompt: must be a list of token ids"),
    ({"prompt": "abc"}, "prompt: expected list"),
    ({"salt": "text"}, "salt: expected bytes"),
    ({"salt": b"x" * (MAX_SALT_BYTES + 1)}, "malformed msgpack"),
    ({"salt": b"x" * 15}, "salt: 15 bytes; a cache salt is empty or 16 bytes"),
    ({"request_id": ""}, "request_id: length 0"),
    ({"params": {"top_k": "5"}}, r"params.top_k: has the wrong type"),
    ({"params": {"temperature": True}}, r"params.temperature: has the wrong type"),
    ({"params": {"max_tokens": 0}}, r"generation request.params: max_tokens"),
    ({"params": {"logit_bias": [[1, "x"]]}}, r"params.logit_bias: has the wrong type"),
    ({"params": {"logit_bias": [[1, 2.0]] * 301}}, r"params.logit_bias: has the wrong type"),
    ({"params": {"logit_bias": [[1, 2.0], [1, 3.0]]}}, r"params: logit_bias must map distinct token ids"),
    ({"params": {"min_p": True}}, r"params.min_p: has the wrong type"),
    ({"params": {"max_tokens": 3, "min_tokens": 4}}, r"params: min_tokens must be an integer in \[0, max_tokens=3\]"),
    ({"first_token_ids": [True]}, "first_token_ids: must be a list of token ids"),
    ({"long_context": [1]}, "long_context: expected dict"),
    ({"resume_token_ids": [[1], "x"]}, "resume_token_ids.sample: expected list"),
    ({"resume_token_ids": [[1, -2]]}, "resume_token_ids.sample: must be a list of token ids"),
    ({"resume_token_ids": [[1] * (4 << 20)]}, "resume_token_ids: over 4194304 tokens with the prompt"),
])
def test_generation_request_violations_name_the_field(changes, match):
    with pytest.raises(WireError, match=match):
        decode_generation(gen_wire(**changes))


@pytest.mark.parametrize("obj, match", [
    ({"index": 0, "tokens": [1], "finished": "yes", "reason": None}, "finished: expected bool"),
    ({"index": -1, "tokens": [1], "finished": False, "reason": None}, "index"),
    ({"index": 0, "tokens": ["a"], "finished": False, "reason": None}, "tokens"),
    ([1], "expected a map"),
])
def test_decode_frame_violations_name_the_field(obj, match):
    with pytest.raises(WireError, match=match):
        decode_frame(obj)


def test_prefill_reply_needs_one_reason_per_first_token():
    body = msgpack.packb({"first_token_ids": [1, 2], "finish_reasons": [None], "handle": None,
                          "num_cached_tokens": 0})
    with pytest.raises(WireError, match="one reason"):
        decode_prefill_reply(body)


def test_prompt_logprobs_round_trip_and_their_violations_name_the_field(monkeypatch):
    """Issue 64: a prefill reply carries the prompt's logprobs; the request's ``prompt_logprobs`` travels in its
    params."""
    entries = [PromptTokenLogprobs(-1.5, 3, ((7, -0.25), (9, -1.0))), PromptTokenLogprobs(-0.125, 1, ((4, -0.125),))]
    reply = PrefillReply([4], [None], HANDLE, 0, prompt_logprobs=entries)
    assert decode_prefill_reply(encode_prefill_reply(reply)) == reply
    msg = GenerationMessage("r", [5, 6], SamplingParams(prompt_logprobs=-1), b"")
    assert decode_generation(encode_generation(msg)).params.prompt_logprobs == -1
    with pytest.raises(WireError, match=r"params: prompt_logprobs must be an integer in \[0, 20\] or -1"):
        decode_generation(gen_wire(params={"prompt_logprobs": 21}))
    base = {"first_token_ids": [1], "finish_reasons": [None], "handle": None, "num_cached_tokens": 0}
    for bad in ([[-1.0, 0, []]], [[-1.0, 1, [[1]]]], [[-1.0, 1, [[1, -1.0]] * 21]], "x"):
        with pytest.raises(WireError, match="prefill reply.prompt_logprobs: expected"):
            decode_prefill_reply(msgpack.packb({**base, "prompt_logprobs": bad}))
    monkeypatch.setattr(wire_module, "MAX_PROMPT_LOGPROB_VALUES", 5)
    assert prompt_logprob_values(3, 1) == 4  # positions 1 and 2, the prompt's token and one alternative each
    with pytest.raises(WireError, match="prompt_logprobs: over 5 logprobs"):
        decode_prefill_reply(msgpack.packb({**base, "prompt_logprobs": [[-1.0, 1, [[1, -1.0]]]] * 3}))
