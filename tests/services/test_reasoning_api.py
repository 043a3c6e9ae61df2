"""Issue 64: ``router.reasoning_parser`` (``--reasoning-parser``) through a real deployment: a chat answer's
thinking in ``message.reasoning_content`` and streamed ``delta.reasoning_content``, its answer in ``content``.

The tiny model's output is held to ``<think>xxxx</think>yyy`` by a regex (structured outputs), so the exact split is
known; each of its bytes is one token, so the streamed tags arrive a character at a time.
"""

from __future__ import annotations

import json
import re
import urllib.request

from tests.services.cluster import Cluster
from tests.services.test_faults import post

FORCED = r"<think>[a-z]{4}</think>[a-z]{3}"


def _chat(url: str, body: dict) -> list[dict]:
    """The streamed chunks of a chat request."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_thinking_apart_from_the_answer_whole_and_streamed(tiny_model_dir) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"regex": FORCED}}
    with Cluster(tiny_model_dir, overrides={"router": {"reasoning_parser": "qwen3"}}) as c:
        req = urllib.request.Request(c.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
        message = out["choices"][0]["message"]
        assert re.fullmatch("[a-z]{4}", message["reasoning_content"]), message
        assert re.fullmatch("[a-z]{3}", message["content"]), message
        chunks = _chat(c.url, body)
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == message["content"]
        assert not any("<" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
        # include_reasoning: false drops the thinking, keeps the answer
        req = urllib.request.Request(c.url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({**body, "include_reasoning": False}).encode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            quiet = json.loads(resp.read())["choices"][0]["message"]
        assert "reasoning_content" not in quiet and quiet["content"] == message["content"]
        # completions are not split
        code, text = post(c.url, {"model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 0,
                                  "structured_outputs": {"regex": FORCED}})
        assert code == 200 and re.fullmatch(FORCED, text["choices"][0]["text"])
