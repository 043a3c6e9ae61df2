"""Issue 13, test 2: the OpenAI API fuzzed from its fields (hypothesis): no answer is a 5xx, the server
stays up, and a fixed request gives the same tokens before and after the fuzz run."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.services.cluster import Cluster, get_json

EXAMPLES = 300
FIXED = {"model": "tiny", "prompt": "the fixed request", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "seed", "stop", "stop_token_ids", "stream", "stream_options", "ignore_eos", "logprobs", "echo",
          "user", "kvrelay", "response_format", "tools", "presence_penalty"]
# Mostly-valid bodies with a few fields replaced by anything, and bodies of anything at all.
base = st.fixed_dictionaries({"model": st.just("tiny"), "prompt": st.text(max_size=30),
                              "max_tokens": st.integers(1, 4)})
bodies = st.one_of(
    st.builds(lambda b, extra: {**b, **extra}, base, st.dictionaries(st.sampled_from(FIELDS), values, max_size=3)),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
    values,
)


def _post(url: str, path: str, body: Any) -> tuple[int, bytes]:
    data = json.dumps(body).encode()  # NaN and Infinity included: Python's JSON reader takes them
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_fuzzed_requests_never_get_a_5xx_and_change_nothing(tiny_model_dir):
    with Cluster(tiny_model_dir, overrides={"prefill": {"ports": []}}) as c:
        status, before = _post(c.url, "/v1/completions", FIXED)
        assert status == 200
        seen: dict[int, int] = {}

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=bodies, chat=st.booleans())
        def fuzz(body: Any, chat: bool) -> None:
            status, answer = _post(c.url, "/v1/chat/completions" if chat else "/v1/completions", body)
            seen[status] = seen.get(status, 0) + 1
            assert status < 500, (body, answer[:300])

        fuzz()
        print(f"\nfuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
        assert sum(seen.values()) >= EXAMPLES and get_json(c.url + "/health")["status"] == "ok"
        status, after = _post(c.url, "/v1/completions", FIXED)
        assert status == 200
        assert json.loads(after)["choices"][0]["text"] == json.loads(before)["choices"][0]["text"]
