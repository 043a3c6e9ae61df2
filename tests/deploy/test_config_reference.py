"""Issue 34: the key declarations (`deploy.config_keys`) cover the config classes and are what the parser reads;
the reference page is generated from them; ``kvrelay config check|show|reference``."""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvrelay.deploy.cli import main
from kvrelay.deploy.config import DEFAULT_CONFIG, Config, load_config, parse_config, parse_root
from kvrelay.deploy.config_keys import KEYS, SECTIONS
from kvrelay.deploy.config_reference import REDACTED, REFERENCE_PATH, REGENERATE, reference_markdown
from kvrelay.deploy.service_config import Section

ROOT = Path(__file__).resolve().parents[2]
# A valid value for every key whose default is unset (the rest are set to their defaults).
EXAMPLES: dict[str, Any] = {
    "model.path": "m", "model.name": "served", "model.revision": "v1", "model.download_dir": "hub",
    "kvstore.dtype": "bfloat16", "kvstore.device.gpu_memory_utilization": 0.9,
    "kvstore.device.bytes": "1GiB", "kvstore.device.fraction_of_free": 0.5,
    "kvstore.host.bytes": "2GiB", "kvstore.host.fraction_of_free": 0.1,
    "kvstore.disk.path": "kv", "kvstore.disk.bytes": "8GiB",
    "internal.max_open_connections": 2000, "router.max_open_connections": 3000,
    "engine.max_model_len": 2048, "engine.attention_backend": "torch", "engine.cuda_graph_batch_sizes": [1, 2],
    "internal.token": "s3cret", "internal.token_env": "KVRELAY_TEST_TOKEN", "router.api_keys_env": "KVRELAY_TEST_KEYS",
    "router.tool_call_parser": "hermes", "router.reasoning_parser": "qwen3",
    "router.chat_template": "{{ messages[0].content }}", "observability.otlp_endpoint": "http://collector:4318/v1/traces",
}
SIZED_BY = ("bytes", "fraction_of_free")  # kvstore.device and kvstore.host take one or the other
DEVICE_ONLY = "gpu_memory_utilization"  # ... and kvstore.device a third way


def leaf_fields(cls: type, prefix: str) -> dict[str, dataclasses.Field]:
    """Attribute path → field, for every non-dataclass field under ``cls`` (through ``X | None`` too)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dataclasses.Field] = {}
    for field in dataclasses.fields(cls):
        path = f"{prefix}.{field.name}" if prefix else field.name
        inner = [t for t in (hints[field.name], *typing.get_args(hints[field.name])) if dataclasses.is_dataclass(t)]
        out.update(leaf_fields(inner[0], path) if inner else {path: field})
    return out


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *sections, name = path.split(".")
        node = out
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = value
    return out


def full_config(sized_by: str) -> dict[str, Any]:
    """Every key set (to its example, else to its default as YAML writes it), the tiers sized by ``sized_by``
    (`DEVICE_ONLY`: the device tier by it, the host tier by bytes)."""
    host_by = "bytes" if sized_by == DEVICE_ONLY else sized_by
    other = {f"kvstore.device.{name}" for name in (*SIZED_BY, DEVICE_ONLY) if name != sized_by}
    other |= {f"kvstore.host.{name}" for name in SIZED_BY if name != host_by}
    return nested({path: EXAMPLES.get(path, list(key.default) if isinstance(key.default, tuple) else key.default)
                   for path, key in KEYS.items() if path not in other})


def test_every_dataclass_field_is_reached_by_a_declared_key_with_a_description():
    fields = leaf_fields(Config, "")
    attrs = {key.attr: key.path for key in KEYS.values() if key.attr is not None}
    assert sorted(fields) == sorted(attrs)
    for key in KEYS.values():
        assert key.doc.strip() and key.doc.endswith("."), key.path
        assert key.check.type and key.check.allowed and key.section in SECTIONS, key.path
        if key.feeds is not None:
            assert KEYS[key.feeds].attr in fields, key.path
    assert set(SECTIONS) == {key.section for key in KEYS.values()}


def test_declared_defaults_are_the_dataclasses_defaults():
    """Where a field has a default and the key's default is not computed, they are one value."""
    fields = leaf_fields(Config, "")
    compared = 0
    for key in KEYS.values():
        if key.attr is None or key.default_text is not None:
            continue
        field = fields[key.attr]
        if field.default is dataclasses.MISSING:
            continue
        assert field.default == key.default, key.path
        compared += 1
    assert compared == 83


def test_the_parser_reads_exactly_the_declared_keys(tmp_path):
    env = {"KVRELAY_TEST_TOKEN": "t", "KVRELAY_TEST_KEYS": "a, b"}
    assert {path for path, key in KEYS.items() if key.default is None} == set(EXAMPLES)
    for sized_by in (*SIZED_BY, DEVICE_ONLY):
        root = Section(full_config(sized_by), "")
        config = parse_root(root, base_dir=tmp_path, gpu_free_bytes=lambda: 1 << 30, env=env)
        assert root.taken == set(KEYS)
        assert (config.internal.token, config.router.api_keys) == ("s3cret", ("a", "b"))
        assert config.kvstore.disk.path == str(tmp_path / "kv")
    with pytest.raises(KeyError):
        Section({}, "router").take("tpot_slo")  # an undeclared key cannot be read


def test_the_committed_reference_is_the_generated_one():
    text = reference_markdown()
    assert (ROOT / REFERENCE_PATH).read_text() == text, f"stale: regenerate it with `{REGENERATE}`"
    for path in KEYS:
        assert text.count(f"| `{path}` |") == 1, path
    assert "| `router.tpot_slo_s` | number | `0.05` | s | >= 0, finite | Under auto," in text
    assert "| `router.max_body_bytes` | size | `1MiB` | bytes |" in text


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvrelay.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(("text", "message"), [
    ("model: {path: m}\nrouter: {tpot_slo: 1}\n", "router.tpot_slo: unknown key; did you mean router.tpot_slo_s?"),
    ("model: {path: m}\nkvstor: {}\n", "kvstor: unknown key; did you mean kvstore?"),
    ("model: {path: m}\ndecode: {long_context: {budget_tokens: 8}}\n",
     "decode.long_context.budget_tokens: unknown key; did you mean decode.long_context.device_budget_tokens?"),
    ("model: {path: m}\nkvstore: {device: {zzz: 1}}\n",
     "kvstore.device.zzz: unknown key; known keys here: bytes, fraction_of_free, gpu_memory_utilization, policy"),
    ("model: {path: m}\nengine: {max_num_seqs: 0}\n", "engine.max_num_seqs: 0 is not a positive integer"),
])
def test_config_check_names_the_key_and_the_closest_known_one(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    assert main(["config", "check", str(path)]) == 2
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", f"kvrelay config check: {message}\n")


def test_config_check_accepts_the_shipped_configs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    paths = sorted(DEFAULT_CONFIG.parent.glob("*.yaml"))
    assert {p.name for p in paths} >= {"gpu-cluster.yaml", "local-2p2d.yaml", "local.yaml"}
    for path in paths:  # gpu-cluster sizes its device tier from NVML: check judges the file, not this machine
        assert main(["config", "check", str(path)]) == 0
        assert capsys.readouterr().out == f"{path}: ok\n"


def test_config_show_fills_in_defaults_redacts_secrets_and_parses_back(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVRELAY_INTERNAL_TOKEN", raising=False)
    monkeypatch.setenv("KVRELAY_TEST_KEYS", "k2")
    path = write(tmp_path, """
        model: {path: m}
        kvstore: {device: {bytes: 64KiB}, host: {fraction_of_free: 0.1}}
        internal: {token: s3cret}
        router: {api_keys: [k1], api_keys_env: KVRELAY_TEST_KEYS, max_body_bytes: 4MiB}
    """)
    assert main(["config", "show", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    assert "s3cret" not in text and "k1" not in text and "k2" not in text
    shown = yaml.safe_load(text)
    assert list(shown) == ["model", "kvstore", "engine", "internal", "prefill", "decode", "router", "observability"]
    assert {f"{s}.{k}" for s, keys in shown.items() for k in keys} >= {p for p in KEYS if p.count(".") == 1}
    assert shown["router"]["tpot_slo_s"] == 0.05
    assert shown["engine"]["max_num_batched_tokens"] == 1024
    assert shown["router"]["max_body_bytes"] == 4 << 20
    assert (shown["internal"]["token"], shown["router"]["api_keys"]) == (REDACTED, [REDACTED, REDACTED])
    assert shown["router"]["api_keys_env"] == "KVRELAY_TEST_KEYS"
    assert shown["kvstore"]["device"] == {"bytes": 65536, "fraction_of_free": None, "policy": "cold-tail",
                                          "gpu_memory_utilization": None}
    assert shown["kvstore"]["host"] == {"bytes": None, "fraction_of_free": 0.1, "policy": "cold-tail"}
    assert shown["kvstore"]["disk"] == {"path": None, "bytes": None, "admit": None, "policy": None}  # no disk tier
    assert shown["decode"]["long_context"]["device_budget_tokens"] == 4096
    assert shown["model"] == {"path": str(Path.cwd() / "m"), "name": "m", "revision": None, "download_dir": None,
                              "dtype": "auto", "device": "auto"}
    original = load_config(path)
    again = parse_config(shown, base_dir=tmp_path, env={})
    assert dataclasses.replace(again, internal=original.internal, router=original.router) == original
    assert again.internal == dataclasses.replace(original.internal, token=REDACTED)
    assert again.router == dataclasses.replace(original.router, api_keys=(REDACTED, REDACTED))


def test_config_show_defaults_to_the_local_config(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["config", "show"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    # device auto: each node decides (0.2 of host memory on CPU, 0.85 of GPU memory on CUDA), so nothing is shown
    assert shown["model"]["device"] == "auto" and shown["kvstore"]["device"]["fraction_of_free"] is None
    assert shown["prefill"]["ports"] == [8100] and shown["decode"]["ports"] == [8200]


def test_config_reference_writes_the_page(tmp_path, capsys):
    out = tmp_path / "reference" / "configuration.md"
    assert main(["config", "reference", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert out.read_text() == reference_markdown()
