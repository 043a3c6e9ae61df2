"""Router pieces without a network: request validation, stop strings, KV index, node choice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from kvrelay.model.tokenizer import load_tokenizer
from kvrelay.router.kv_index import KvIndex
from kvrelay.router.nodes import NodeSet
from kvrelay.router.openai_api import ApiError, ServedModel, parse_chat, parse_completion
from kvrelay.router.text_output import SampleText, StopScanner


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> ServedModel:
    return ServedModel("tiny", 258, 128, 4, load_tokenizer(tiny_model_dir))


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ([1, 2], 400, "the request body must be a JSON object"),
        ({"model": "other", "prompt": "x"}, 404, "model 'other' not found; this server serves 'tiny'"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens must be at least 1, got -3"),
        ({"model": "tiny", "prompt": "x", "n": 5}, 400, "n must be between 1 and 4 on this server, got 5"),
        ({"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature must be in [0, 2], got -0.5"),
        ({"model": "tiny", "prompt": "x", "stop": list("abcde")}, 400, "stop takes at most 4 strings, got 5"),
        ({"model": "tiny", "prompt": [1, 258]}, 400, "token id 258 at position 1 is outside the vocabulary [0, 258)"),
        ({"model": "tiny", "prompt": []}, 400, "prompt is empty"),
        ({"model": "tiny", "prompt": [1] * 120, "max_tokens": 9}, 400, "context window is 128 tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "9"}, 400, "max_tokens must be an integer, got str"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs must be in [0, 20], got 21"),
        ({"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1}, 400,
         "echo with logprobs (the prompt's logprobs in the choice's logprobs) is not built; ask for them with "
         "prompt_logprobs instead"),
        ({"model": "tiny", "prompt": ["ok", [1, 900]]}, 400, "token id 900 at position 1 is outside the vocabulary"),
        ({"model": "tiny", "prompt": ["ok", []]}, 400, "prompt[1] is empty"),
        ({"model": "tiny", "prompt": ["ok", 5]}, 400, "prompt[1] must be a string or a list of token ids"),
        ({"model": "tiny", "prompt": ["p"] * 65}, 400, "prompt takes at most 64 prompts per request, got 65"),
        ({"model": "tiny", "prompt": {"a": 1}}, 400,
         "prompt must be a string, a list of token ids, or a list of several of either"),
        # issue 13: every per-request size and range is capped with a named 400 (no 500s)
        ({"model": "tiny", "prompt": "x", "temperature": float("nan")}, 400, "temperature must be in [0, 2], got nan"),
        ({"model": "tiny", "prompt": "x", "temperature": 10**400}, 400, "temperature is out of range"),
        ({"model": "tiny", "prompt": "x", "top_p": float("nan")}, 400, "top_p must be in (0, 1], got nan"),
        ({"model": "tiny", "prompt": "x", "top_k": 2**64}, 400, "top_k must be -1 or 0 (disabled) or at most the "
                                                               "vocabulary size (258), got 18446744073709551616"),
        ({"model": "tiny", "prompt": "x", "stop": "s" * 1025}, 400, "a stop string is at most 1024 characters"),
        ({"model": "tiny", "prompt": "x", "stop_token_ids": list(range(65))}, 400,
         "stop_token_ids takes at most 64 ids, got 65"),
        ({"model": "tiny", "prompt": "x", "stop_token_ids": [2**64]}, 400,
         "token id 18446744073709551616 at position 0 is outside the vocabulary [0, 258)"),
        ({"model": "tiny", "prompt": "x", "seed": 2**64}, 400, "seed must be in [0, 2**63)"),
        # issue 15: unsupported features are refused by name, never ignored; new knobs have named ranges
        # response_format is served (issue 32, tests/router/test_structured_api.py); an unknown type is named
        ({"model": "tiny", "prompt": "x", "response_format": {"type": "xml"}}, 400,
         "response_format.type must be text, json_object or json_schema, got 'xml'"),
        # tools and tool_choice are served (issue 32, tests/router/test_tool_calls.py); the deprecated ones are not
        ({"model": "tiny", "prompt": "x", "functions": [{"name": "f"}]}, 400, "functions is not supported"),
        ({"model": "tiny", "prompt": "x", "function_call": "auto"}, 400, "function_call is not supported"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400,
         "presence_penalty must be in [-2, 2], got 2.5"),
        ({"model": "tiny", "prompt": "x", "frequency_penalty": float("nan")}, 400,
         "frequency_penalty must be in [-2, 2], got nan"),
        ({"model": "tiny", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty must be in (0, 2], got 0"),
        ({"model": "tiny", "prompt": "x", "min_p": 1.5}, 400, "min_p must be in [0, 1], got 1.5"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400,
         "min_tokens must be in [0, max_tokens=4], got 5"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias: 'abc' is not a token id"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"300": 1}}, 400,
         "logit_bias: token id 300 is outside the vocabulary [0, 258)"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400,
         "logit_bias['5'] must be a number in [-100, 100], got 101"),
    ],
)
def test_completion_validation(served, body, status, message):
    with pytest.raises(ApiError) as err:
        parse_completion(body, served)
    assert err.value.status == status
    assert message in err.value.message


def test_valid_completion_and_chat(served):
    req = parse_completion({"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_k": -1,
                            "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "user": "u"},
                           served)
    assert req.prompt_token_ids == [256, ord("h"), ord("i")]
    assert (req.params.max_tokens, req.params.temperature, req.params.top_k) == (5, 0.0, 0)
    assert req.stop == ("x",) and req.stream and req.include_usage
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hey"}]}, served)
    text = served.tokenizer.apply_chat_template([{"role": "user", "content": "hey"}])
    assert chat.prompt_token_ids == served.tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(ApiError, match="messages must be a non-empty list"):
        parse_chat({"model": "tiny", "messages": []}, served)


def test_stop_string_cuts_text_and_holds_back_partial_match(served):
    tok = served.tokenizer
    st = SampleText(tok, ("END",))
    out = st.push(tok.encode("hello E", add_special_tokens=False))
    assert out == "hello " and not st.stopped  # "E" may start "END": held back
    out += st.push(tok.encode("Nx", add_special_tokens=False))
    assert out == "hello ENx" and not st.stopped  # "ENx" cannot start "END" any more
    out += st.push(tok.encode("y END more", add_special_tokens=False))
    assert st.stopped and out == "hello ENxy "
    plain = SampleText(tok, ())
    assert plain.push(tok.encode("abc", add_special_tokens=False)) + plain.flush() == "abc"


def test_kv_index_prefix_per_node():
    idx = KvIndex()
    k = [bytes([i]) * 32 for i in range(4)]
    idx.apply("a", k[:3], (), 3)
    idx.apply("b", k[:1], (), 1)
    assert idx.prefix_blocks(k, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    idx.apply("a", (), [k[1]], 4)
    assert idx.prefix_blocks(k, ["a", "b"]) == {"a": 1, "b": 1}
    idx.replace("b", k, 9)
    assert idx.prefix_blocks(k, ["a", "b"]) == {"a": 1, "b": 4}
    idx.drop_node("b")
    assert idx.prefix_blocks(k, ["b"]) == {"b": 0} and "b" not in idx.node_to_last_seq


def test_prefill_choice_weighs_prefix_against_queue():
    nodes = NodeSet(["http://p0", "http://p1"], ["http://d0", "http://d1"], block_size_tokens=16)
    keys = [bytes([i]) * 32 for i in range(4)]
    nodes.index.apply("prefill-1", keys, (), 4)
    assert nodes.pick_prefill(keys, 70).name == "prefill-1"  # cost 70-64=6 vs 70
    nodes.prefill[1].queued_tokens = 100
    assert nodes.pick_prefill(keys, 70).name == "prefill-0"  # 106 vs 70
    nodes.mark_down(nodes.prefill[0], "NodeUnavailable: refused")
    assert nodes.pick_prefill(keys, 70).name == "prefill-1"
    assert nodes.prefill[0].last_error == "NodeUnavailable: refused" and nodes.prefill[0].failures == 1
    nodes.mark_up(nodes.prefill[0])
    assert nodes.prefill[0].last_error == "" and nodes.prefill[0].healthy(0.0)
    nodes.mark_down(nodes.prefill[0])
    nodes.decode[0].in_flight = 2
    assert nodes.pick_decode(keys).name == "decode-1"
    assert nodes.pick_decode(keys, exclude={"decode-1"}).name == "decode-0"


def test_up_says_which_nodes_it_waits_for():
    from kvrelay.deploy.up import _waiting_for

    assert _waiting_for(None) == "the router does not answer /health"
    assert _waiting_for({"status": "starting"}) == "router status 'starting'"
    health = {"status": "degraded", "nodes": {
        "decode-0": {"healthy": False, "last_error": "NodeUnavailable: timed out"},
        "prefill-0": {"healthy": False, "last_error": ""},
        "prefill-1": {"healthy": True, "last_error": "", "capacity": {"kv_blocks": 182}},
        "prefill-2": {"healthy": True, "last_error": "", "capacity": None}}}
    assert _waiting_for(health) == ("waiting for decode-0 (NodeUnavailable: timed out), prefill-0 (not answered yet), "
                                    "prefill-2 (no load report yet)")


def _first_stop(text: str, stops: tuple[str, ...]) -> int:
    """Reference: where the stop string that completes first (earliest end; ties: first listed) begins."""
    best_end, start = None, -1
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best_end is None or i + len(s) < best_end):
            best_end, start = i + len(s), i
    return start


def _partial(text: str, stops: tuple[str, ...]) -> int:
    """Reference: the longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@given(hs.lists(hs.text("ab", min_size=1, max_size=6), min_size=1, max_size=3).map(tuple),
       hs.lists(hs.text("abc", max_size=5), max_size=8))
@settings(max_examples=400, deadline=None)
def test_stop_scanner_matches_a_brute_force_search(stops, pieces):
    """The streaming KMP scanner finds what searching the whole text again after every piece finds."""
    scanner = StopScanner(stops)
    text = ""
    for piece in pieces:
        found = scanner.feed(piece)
        text += piece
        if found >= 0:
            assert found == _first_stop(text, stops)
            return
        assert _first_stop(text, stops) == -1
        assert scanner.partial == _partial(text, stops)


def test_chat_image_parts_are_refused_by_name(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    with pytest.raises(ApiError, match="messages\\[0\\].content: 'image_url' parts are not supported; this server "
                                       "takes text parts only"):
        parse_chat(body, served)


def test_chat_logprobs_take_a_flag_and_a_count(served):
    msgs = [{"role": "user", "content": "hi"}]
    with_top = {"model": "tiny", "messages": msgs, "logprobs": True, "top_logprobs": 3}
    assert parse_chat(with_top, served).params.logprobs == 3
    assert parse_chat({"model": "tiny", "messages": msgs, "logprobs": True}, served).params.logprobs == 0
    assert parse_chat({"model": "tiny", "messages": msgs}, served).params.logprobs is None
    with pytest.raises(ApiError, match="top_logprobs needs logprobs: true"):
        parse_chat({"model": "tiny", "messages": msgs, "top_logprobs": 2}, served)
    with pytest.raises(ApiError, match="top_logprobs must be in \\[0, 20\\], got 21"):
        parse_chat({"model": "tiny", "messages": msgs, "logprobs": True, "top_logprobs": 21}, served)


def test_several_prompts_make_one_request_each_and_echo_keeps_the_prompt_text(served):
    from kvrelay.router.openai_api import parse_completions, parse_detokenize, parse_tokenize

    tok = served.tokenizer
    reqs = parse_completions({"model": "tiny", "prompt": ["ab", "cd", "ef"], "n": 2, "max_tokens": 3}, served)
    assert [r.prompt_token_ids for r in reqs] == [tok.encode(p) for p in ("ab", "cd", "ef")]
    assert len({r.request_id for r in reqs}) == 3 and {r.params.n for r in reqs} == {2}
    ids = parse_completions({"model": "tiny", "prompt": [[5, 6], [7]], "echo": True}, served)
    assert [r.prompt_token_ids for r in ids] == [[5, 6], [7]]
    assert [r.echo_text for r in ids] == [tok.decode([5, 6]), tok.decode([7])]
    assert parse_completions({"model": "tiny", "prompt": "hi", "echo": True}, served)[0].echo_text == "hi"
    assert parse_tokenize({"model": "tiny", "prompt": "hello"}, served) == tok.encode("hello")
    msgs = [{"role": "user", "content": "hey"}]
    assert parse_tokenize({"model": "tiny", "messages": msgs}, served) == \
        parse_chat({"model": "tiny", "messages": msgs}, served).prompt_token_ids
    assert parse_detokenize({"model": "tiny", "tokens": tok.encode("round trip", add_special_tokens=False)},
                            served) == "round trip"
    with pytest.raises(ApiError, match="tokens is required"):
        parse_detokenize({"model": "tiny"}, served)


@pytest.mark.parametrize(("node_keepalive_s", "client_s"), [(75.0, 15.0), (30.0, 15.0), (20.0, 10.0), (2.0, 1.0)])
def test_pooled_connections_to_nodes_close_before_the_nodes_close_them(node_keepalive_s, client_s):
    """The router's three pools idle out at half the nodes' own keep-alive (at most aiohttp's 15 s; a decode
    node's pool to its owners takes the same `client_keepalive_s`): the caller closes first, so no request goes
    down a connection the node is closing. test_load's 4,000-client variants (`-m slow`) run with a 2 s node
    keep-alive and assert that no node was ever taken out."""
    import asyncio

    from kvrelay.router.backends import Backends
    from kvrelay.transfer.config import client_keepalive_s

    assert client_keepalive_s(node_keepalive_s) == client_s

    async def pools() -> list[float]:
        backends = Backends(internal_token=None, timeout_s=5.0, node_keepalive_s=node_keepalive_s)
        await backends.start()
        try:
            return [s.connector._keepalive_timeout for s in (backends._session, backends._control, backends._health)]
        finally:
            await backends.close()

    assert asyncio.run(pools()) == [client_s] * 3
