"""The `kvrelay` command as a user runs it: tiny-model, generate (text and token ids), errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams


def kvrelay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", *args], capture_output=True, text=True,
                          timeout=120)


def wait_serving(proc: subprocess.Popen, out: list[str], timeout_s: float = 180.0) -> str:
    """Read ``kvrelay serve``'s output into ``out`` until it says it is serving; all of it so far. Fails (with the
    last lines) when the process exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not any("kvrelay is serving" in line for line in out):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(out[-40:])
        out.append(proc.stdout.readline())
    return "".join(out)


def kvrelay_all(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """``kvrelay(*args)`` for each of ``commands``, all running at once (each spends most of its time importing)."""
    return run_all(*((None, args) for args in commands))


def run_all(*runs: tuple[dict[str, str] | None, tuple[str, ...]]) -> list[subprocess.CompletedProcess]:
    """``kvrelay ARGS`` under ``ENV`` (None: this process's) for each ``(ENV, ARGS)``, all at once."""
    procs = [subprocess.Popen([sys.executable, "-m", "kvrelay.deploy.cli", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for env, args in runs]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, outs, strict=True)]


def test_tiny_model_then_generate_json(tmp_path: Path):
    out, again = kvrelay_all(("tiny-model", str(tmp_path / "m"), "--seed", "3", "--layers", "1"),
                             ("tiny-model", str(tmp_path / "m2"), "--seed", "3", "--layers", "1"))
    assert out.returncode == 0, out.stderr
    assert again.returncode == 0, again.stderr
    for f in sorted(p.name for p in (tmp_path / "m").iterdir()):
        assert (tmp_path / "m" / f).read_bytes() == (tmp_path / "m2" / f).read_bytes(), f
    run = kvrelay("generate", "--model", str(tmp_path / "m"), "--prompt", "Hello", "--max-tokens", "6", "--json")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    engine = LLMEngine(load_model(tmp_path / "m"), EngineConfig(num_blocks=16))
    [[want]] = engine.generate([[256] + list(b"Hello")], SamplingParams(max_tokens=6))
    assert got["token_ids"] == want
    assert isinstance(got["text"], str)


def test_prompt_ids_need_no_tokenizer_and_bad_input_is_named(tmp_path: Path, tiny_model_dir: Path):
    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    gpt2 = tmp_path / "gpt2"  # the same, of an architecture kvrelay does not serve
    shutil.copytree(model, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    run, bad, text, arch = kvrelay_all(
        ("generate", "--model", str(model), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"),
        ("generate", "--model", str(model), "--prompt-ids", "1,999", "--max-tokens", "4"),
        ("generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "4"),
        ("generate", "--model", str(gpt2), "--prompt-ids", "1", "--max-tokens", "1"))
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) == 4 and json.loads(run.stdout)["text"] == ""
    assert bad.returncode == 2 and "token id 999 at position 1 is outside the vocabulary [0, 258)" in bad.stderr
    assert text.returncode == 2 and "has no tokenizer.json; pass --prompt-ids" in text.stderr
    assert arch.returncode == 2 and "gpt2" in arch.stderr and "llama" in arch.stderr


def test_store_stats_and_clear_per_node(tmp_path: Path, tiny_model_dir: Path):
    import yaml
    from kvrelay.deploy.config import for_node, load_config
    from kvrelay.kvstore.block_key import BlockKey
    from kvrelay.kvstore.tiered_store import TieredStore

    cfg = tmp_path / "kv.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model_dir)},
        "kvstore": {"device": {"bytes": "1MiB"}, "disk": {"path": str(tmp_path / "disk"), "bytes": "64MiB"}},
        "prefill": {"ports": [1]}, "decode": {"ports": [2]},
    }))
    config = load_config(cfg)
    spec = LLMEngine.block_spec_for(load_model(tiny_model_dir), 16)
    store = TieredStore(spec, for_node(config.kvstore, "prefill-0").store_config(spec))
    [b] = store.block_pool.allocate(1)
    store.block_pool.register_key(b, BlockKey(b"\x01" * 32))
    assert store.persist() == 1
    store.close()
    stats = json.loads(kvrelay("store", "stats", "--config", str(cfg)).stdout)
    assert sorted(stats) == ["decode-0", "prefill-0"]
    assert stats["prefill-0"]["tiers"]["disk"]["num_blocks"] == 1
    assert stats["decode-0"]["tiers"]["disk"]["num_blocks"] == 0
    bad = kvrelay("store", "stats", "--config", str(cfg), "--node", "prefill-7")
    assert bad.returncode == 2 and "'prefill-7' is not a node of this config (prefill-0, decode-0)" in bad.stderr
    cleared = kvrelay("store", "clear", "--config", str(cfg), "--node", "prefill-0")
    assert cleared.returncode == 0 and json.loads(cleared.stdout)["removed"] == [str(tmp_path / "disk" / "prefill-0")]


def test_every_bench_name_resolves_to_its_main() -> None:
    from kvrelay.deploy.cli import BENCH_NAMES, _bench_main

    mains = {name: _bench_main(name) for name in BENCH_NAMES}
    modules = {"bandwidth": "bandwidth_bench", "cache-policies": "cache_policies", "cuda-graphs": "graph_bench",
               "decode": "decode_bench", "deterministic": "deterministic_bench", "disk-prefix": "disk_prefix_bench",
               "dtype": "dtype_bench", "edges": "edges_bench", "goodput": "goodput_bench", "guard": "guard_bench",
               "hybrid-kv": "hybrid_kv_bench", "install": "install_time",
               "kernel": "kernel_bench", "kernel-plan": "kernel_plan_bench", "load": "load",
               "long-context": "long_context_bench", "memory": "memory_bench", "migration": "migration_bench",
               "mla": "mla_bench", "prefill": "prefill_bench", "serve": "serve_bench", "structured": "structured_bench",
               "tiers": "tier_bench", "tracing": "tracing_bench", "transfer": "transfer_bench",
               "ttft-prefix": "ttft_prefix", "vllm-client": "vllm_client"}
    assert {name: f.__module__ for name, f in mains.items()} == {
        name: f"kvrelay.benchmarks.{module}" for name, module in modules.items()}
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        _bench_main("nope")


def test_a_node_name_that_cannot_be_an_agent_name_or_a_directory_is_refused(tmp_path: Path, tiny_model_dir: Path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_dir}}}\nkvstore: {{device: {{bytes: 8MiB}}}}\n")
    for bad in ("../etc", "a b", ".hidden", "x" * 64):
        done = subprocess.run([sys.executable, "-m", "kvrelay.deploy.cli", "decode", "--config", str(cfg),
                               f"--name={bad}"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        assert f"kvrelay decode: --name {bad!r} is not a node name" in done.stderr


def test_serve_takes_vllm_flags_over_the_yaml_and_says_what_it_runs(tmp_path: Path, tiny_model_dir: Path):
    """Issue 15: `kvrelay serve MODEL [vLLM's flags]`: one engine node and the router; flags override the
    YAML; the effective config is printed; a bad value is named."""
    import json
    import os
    import signal
    import urllib.request

    import yaml
    from kvrelay.benchmarks.deployment import free_ports

    base = tmp_path / "base.yaml"
    base.write_text("kvstore: {block_size_tokens: 16, device: {bytes: 64MiB}}\nengine: {max_num_seqs: 64}\n")
    [port] = free_ports(1)
    bad = kvrelay("serve", str(tiny_model_dir), "--config", str(base), "--kv-cache-memory", "lots")
    assert bad.returncode == 2 and "kvstore.device.bytes: 'lots' is not a size" in bad.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.deploy.cli", "serve", str(tiny_model_dir), "--config", str(base),
         "--port", str(port), "--served-model-name", "foo", "--block-size", "32", "--max-num-seqs", "4",
         "--no-enable-prefix-caching", "--kv-cache-memory", "16MiB", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out: list[str] = []
    try:
        text = wait_serving(proc, out)
        effective = yaml.safe_load(text.split("effective config (", 1)[1].split("):\n", 1)[1].split("\n\n")[0])
        assert effective["kvstore"]["block_size_tokens"] == 32 and effective["kvstore"]["device"] == {"bytes": "16MiB"}
        assert effective["engine"] == {"max_num_seqs": 4, "enable_prefix_caching": False}
        assert effective["model"]["name"] == "foo" and effective["prefill"]["ports"] == []
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["foo"]
        body = json.dumps({"model": "foo", "prompt": list(range(3, 90)), "max_tokens": 4, "temperature": 0}).encode()
        for _ in range(2):  # the same prompt twice: with prefix caching off, nothing is reused
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        decode = f"http://127.0.0.1:{effective['decode']['ports'][0]}"
        with urllib.request.urlopen(decode + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert "kvrelay_engine_prefix_hit_tokens_total 0.0" in metrics
        assert "kvrelay_engine_prefill_tokens_total 174.0" in metrics  # 87 prompt tokens, computed twice
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_tiny_model_with_real_shapes_in_bf16_loads_and_generates(tmp_path: Path):
    """What the GPU check builds at Llama-3.1-8B's shapes, here at a small size: bf16 weights, a set MLP width."""
    out = kvrelay("tiny-model", str(tmp_path / "m"), "--layers", "1", "--hidden", "128", "--heads", "4",
                  "--kv-heads", "1", "--intermediate", "384", "--weights-dtype", "bfloat16")
    assert out.returncode == 0, out.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["torch_dtype"], config["intermediate_size"], config["head_dim"]) == ("bfloat16", 384, 32)
    import torch
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    run = kvrelay("generate", "--model", str(tmp_path / "m"), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--json")
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) == 3


def test_up_refuses_a_long_context_policy_for_a_windowed_model_before_any_node_starts(tmp_path: Path):
    import yaml
    from kvrelay.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "gpt-oss", arch="gpt-oss")
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(model)}, "prefill": {"ports": [0]},
        "kvstore": {"device": {"bytes": "8MiB"}, "host": {"bytes": "8MiB", "fraction_of_free": None}},
        "decode": {"ports": [0], "long_context": {"policy": "h2o"}},
    }))
    run = kvrelay("up", "--config", str(cfg))
    assert run.returncode == 2
    assert ("kvrelay: config error: decode.long_context.policy: h2o is not supported for a model with "
            f"sliding-window layers (gpt_oss), {model}; use none") in run.stderr
    assert "kvrelay up:" not in run.stdout  # refused before sizing memory or starting a node


def test_tiny_model_arch_choices_are_the_families_model_tiny_writes():
    from kvrelay.deploy.cli import TINY_ARCH_CHOICES
    from kvrelay.model.tiny import TINY_ARCHS

    assert TINY_ARCH_CHOICES == TINY_ARCHS
