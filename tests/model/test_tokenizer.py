"""`load_tokenizer`: special tokens, chat templates rendered as transformers renders them, streaming decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from kvrelay.model.stream_decoder import stream_decoder
from kvrelay.model.tiny import BOS_ID, EOS_ID, write_tiny_model
from kvrelay.model.tokenizer import load_tokenizer
from transformers import AutoTokenizer

LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "" %}
{%- endif %}
{{- "<|system|>\\n" + system + "\\n" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("roles must be user or assistant, got " + message['role']) }}
    {%- endif %}
    {{- "<|" + message['role'] + "|>\\n" + message['content'] | trim + "\\n" }}
    {%- if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|assistant|>\\n" }}
{%- endif %}
"""

# Block tags without "-": trim_blocks / lstrip_blocks decide the whitespace.
PLAIN_BLOCKS_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
U: {{ message['content'] }}
    {% else %}
A: {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tok") / "tiny")


def _with_tokenizer_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return dst


@pytest.mark.parametrize("template", [LLAMA3_STYLE_TEMPLATE, PLAIN_BLOCKS_TEMPLATE], ids=["dash", "plain"])
def test_templates_render_like_transformers(tiny_dir: Path, tmp_path: Path, template: str) -> None:
    model_dir = _with_tokenizer_config(tiny_dir, tmp_path / "m", chat_template=template)
    ours, hf = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "<b>x</b> & y"},
                {"role": "assistant", "content": "ok", "tool_calls": [{"name": "f", "arguments": {"a": "<"}}]},
                {"role": "user", "content": "again"}]
    for add in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_raise_exception_reaches_the_caller(tiny_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(_with_tokenizer_config(tiny_dir, tmp_path / "m", chat_template=LLAMA3_STYLE_TEMPLATE))
    with pytest.raises(jinja2.TemplateError, match="roles must be user or assistant, got tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed(tiny_dir: Path, tmp_path: Path) -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tok = load_tokenizer(_with_tokenizer_config(tiny_dir, tmp_path / "m", chat_template=escape))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_chat_template_is_a_clear_error(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(model_dir)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="has no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_is_used(tiny_dir: Path, tmp_path: Path) -> None:
    """transformers 5.x `save_pretrained` writes the template to chat_template.jinja."""
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_tokenizer(model_dir).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


@pytest.mark.parametrize("changes", [{"bos_token": None}, {"add_bos_token": False}, {"add_bos_token": True}],
                         ids=["null-bos", "add-bos-false", "add-bos-true"])
def test_tokenizer_json_decides_bos_as_in_transformers(tiny_dir: Path, tmp_path: Path, changes: dict) -> None:
    """transformers 5.x ignores add_bos_token / a null bos_token: tokenizer.json's post-processor adds BOS."""
    model_dir = _with_tokenizer_config(tiny_dir, tmp_path / "m", **changes)
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert load_tokenizer(model_dir).encode("hi") == hf("hi").input_ids == [BOS_ID, 104, 105]


def test_eos_ids_merge_tokenizer_and_config(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [EOS_ID, 10]}))
    assert load_tokenizer(model_dir).eos_token_ids == (EOS_ID, 10)


def test_no_tokenizer_json_gives_none(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) is None


def test_stream_decoder_holds_back_partial_utf8(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    text = "héllo 😀 wörld"
    stream = stream_decoder(tok)
    deltas = [stream.push([i]) for i in tok.encode(text)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[0] == "" and deltas[2] == "" and deltas[3] == "é"  # BOS, then the 2-byte é at once
    assert stream.push([EOS_ID]) == ""
    assert tok.vocab_size == 258 and BOS_ID == 256
