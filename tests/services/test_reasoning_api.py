"""Issue 64: ``router.reasoning_parser`` (``--reasoning-parser``) through a real deployment: a chat answer's
thinking in ``message.reasoning_content`` and streamed ``delta.reasoning_content``, its answer in ``content``; and
``router.chat_template`` (``--chat-template``) in place of the model's template.

The tiny model's output is held to ``<think>xxxx</think>yyy`` by a regex (structured outputs), so the exact split is
known; each of its bytes is one token, so the streamed tags arrive a character at a time.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from kvrelay.deploy.config import DEFAULT_CONFIG, ConfigError, load_config
from kvrelay.model.tokenizer import load_tokenizer

from tests.services.cluster import Cluster
from tests.services.test_faults import post

FORCED = r"<think>[a-z]{4}</think>[a-z]{3}"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path):
    with Cluster(tiny_model_dir, overrides={"router": {"reasoning_parser": "qwen3", "chat_template": TEMPLATE}}) as c:
        yield c


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _stream(url: str, body: dict) -> list[dict]:
    """The streamed chunks of a chat request."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_thinking_apart_from_the_answer_whole_and_streamed(cluster: Cluster) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 40,
            "temperature": 0, "structured_outputs": {"regex": FORCED}}
    message = _post(cluster.url, "/v1/chat/completions", body)["choices"][0]["message"]
    assert re.fullmatch("[a-z]{4}", message["reasoning_content"]), message
    assert re.fullmatch("[a-z]{3}", message["content"]), message
    deltas = [ch["choices"][0]["delta"] for ch in _stream(cluster.url, body) if ch["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert not any("<" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    # include_reasoning: false drops the thinking, keeps the answer
    quiet = _post(cluster.url, "/v1/chat/completions", {**body, "include_reasoning": False})["choices"][0]["message"]
    assert "reasoning_content" not in quiet and quiet["content"] == message["content"]
    # completions are not split
    code, out = post(cluster.url, {"model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 0,
                                   "structured_outputs": {"regex": FORCED}})
    assert code == 200 and re.fullmatch(FORCED, out["choices"][0]["text"])


def test_the_chat_template_given_renders_every_chat(cluster: Cluster, tiny_model_dir: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = _post(cluster.url, "/tokenize", {"model": "tiny", "messages": messages})
    want = load_tokenizer(tiny_model_dir).encode("<system>Be brief.\n<user>Hi\n<assistant>", add_special_tokens=False)
    assert got["tokens"] == want


def test_a_chat_template_that_is_not_one_is_refused_when_the_config_is_read(tmp_path: Path) -> None:
    import yaml

    base = yaml.safe_load(DEFAULT_CONFIG.read_text())
    for value, message in (("{% for m in messages %}",
                            "chat template (inline) does not compile: Unexpected end of template"),
                           (str(tmp_path / "none.jinja"), "is neither a file nor a Jinja template")):
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump({**base, "router": {**base.get("router", {}), "chat_template": value}}))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(config, gpu_free_bytes=lambda: 0)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    config.write_text(yaml.safe_dump({**base, "router": {**base.get("router", {}),
                                                          "chat_template": str(tmp_path / "t.jinja")}}))
    assert load_config(config, gpu_free_bytes=lambda: 0).router.chat_template == str(tmp_path / "t.jinja")
