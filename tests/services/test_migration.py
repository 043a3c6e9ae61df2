"""Issue 30: a decode node that dies mid-stream — its requests move to another decode node and finish there.

The client sees one uninterrupted stream: greedy and seeded samples end with exactly the tokens an
undisturbed run gives, and the streamed text has no piece repeated or lost.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer

from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_faults import post, wait_for

STREAMS = 50
MAX_TOKENS = 850  # long enough that no stream ends before the last has begun, on a loaded machine (600 once
# was not, in a full suite after the C++ rotary and silu made float32 decode steps faster); prompts are 136 tokens
PREFIX_TOKENS = 128  # 8 blocks, cached on the first decode node before the streams start


def reference(model_dir, prompts: list[list[int]], params: list[SamplingParams], *, dtype: str = "float32",
              **config: object) -> list[list[int]]:
    """The requests in one in-process engine of ``dtype`` (float32, like the cluster; a sample's tokens do not depend
    on its batch there: `tests/engine/test_engine.py`), ``config`` over the engine's sizes here."""
    sizes: dict[str, object] = {"num_blocks": 2048, "max_model_len": 1024, "max_num_seqs": 64, **config}
    eng = LLMEngine(load_model(model_dir, dtype=dtype), EngineConfig(**sizes))
    out: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", prompt, p)
        out[f"r{i}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


class Stream:
    """One streaming completion read in a thread: its text pieces and how many chunks came."""

    def __init__(self, client: openai.OpenAI, prompt: list[int], body: dict) -> None:
        self.pieces: list[str] = []
        self.finish: str | None = None
        self.usage = None
        self.error: Exception | None = None
        self.started = threading.Event()
        self._args = (client, prompt, body)

    def __call__(self) -> Stream:
        client, prompt, body = self._args
        try:
            for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                   stream_options={"include_usage": True}, **body):
                if chunk.usage is not None:
                    self.usage = chunk.usage
                for choice in chunk.choices:
                    self.pieces.append(choice.text)
                    if len("".join(self.pieces)) >= 10:
                        self.started.set()
                    if choice.finish_reason is not None:
                        self.finish = choice.finish_reason
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        self.started.set()
        return self


def stream_requests(streams: int, max_tokens: int, *, seed_base: int) -> tuple[list[dict], list[SamplingParams]]:
    """The API bodies and the engine's params of ``streams`` requests of ``max_tokens`` each: greedy for even
    indices, seeded top-p samples (seed ``seed_base + i``) for odd ones."""
    bodies = [{"max_tokens": max_tokens, "extra_body": {"ignore_eos": True}, "temperature": 0}
              if i % 2 == 0 else
              {"max_tokens": max_tokens, "extra_body": {"ignore_eos": True}, "temperature": 1.0, "top_p": 0.95,
               "seed": seed_base + i} for i in range(streams)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=b["temperature"],
                             top_p=b.get("top_p", 1.0), seed=b.get("seed")) for b in bodies]
    return bodies, params


def test_killing_a_decode_node_under_50_streams_moves_them_all(tiny_model_dir):
    """Half the streams greedy, half seeded samples (top-p), in one deployment: both kinds must resume exactly
    (one run for both: each such run costs ~35 s of CI)."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 256) for _ in range(PREFIX_TOKENS)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(8)] for _ in range(STREAMS)]
    bodies, params = stream_requests(STREAMS, MAX_TOKENS, seed_base=1000)
    expected = reference(tiny_model_dir, prompts, params)
    tok = load_tokenizer(tiny_model_dir)
    assert tok is not None
    # Room for all 50 at once on every node (prefill: 4 steps of max_num_batched_tokens), so they run together.
    overrides = {"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
                 "kvstore": {"device": {"bytes": "256MiB"}},
                 # Load weighs little against a cached prefix: every stream goes to the decode node holding it.
                 "router": {"load_weight_tokens": 1}}
    with Cluster(tiny_model_dir, prefill=1, decode=2, overrides=overrides) as c:
        survivor = c.decode_urls[1]
        warm = {"model": "tiny", "prompt": prefix, "max_tokens": 2, "temperature": 0}
        assert post(c.url, warm)[0] == 200

        def indexed() -> bool:
            nodes = get_json(c.url + "/health")["nodes"]
            return nodes["decode-0"]["kv_keys"] >= PREFIX_TOKENS // 16

        wait_for(indexed, what="the victim's prefix blocks indexed")
        streams_moved_by_a_kill(c, prompts, bodies, [tok.decode(e) for e in expected], MAX_TOKENS)
        m = metrics(c.url)
        assert m['kvrelay_router_migrations_total{outcome="moved"}'] == STREAMS
        assert m.get('kvrelay_router_migrations_total{outcome="limit"}', 0.0) == 0
        assert get_json(survivor + "/health")["running"] == 0
        wait_for(lambda: idle([*c.prefill_urls, survivor]), what="every block given back")


def streams_moved_by_a_kill(c: Cluster, prompts: list[list[int]], bodies: list[dict], texts: list[str],
                            max_tokens: int) -> None:
    """Stream every prompt (with ``bodies[i]``) through ``c``, wait until all run on its first decode node, SIGKILL
    that node, and check each stream ends with ``max_tokens`` tokens whose text is ``texts[i]``."""
    victim, survivor = c.decode_urls
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=300)
    streams = [Stream(client, p, b) for p, b in zip(prompts, bodies, strict=True)]
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(s) for s in streams]
        for s in streams:
            assert s.started.wait(120), "a stream sent no text"
        # All on the victim: a stream's text may reach the client a moment before its request is counted
        # running (a sample's first token comes from the prefill node).
        running: list[int] = []

        def all_on_the_victim() -> bool:
            running[:] = [get_json(u + "/health")["running"] for u in (victim, survivor)]
            return running == [len(streams), 0]

        # 30 s: the full suite on a busy machine once timed out here at 10 s (its counts were not shown then)
        try:
            wait_for(all_on_the_victim, timeout_s=30, what=f"all {len(streams)} streams running on the victim")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; running on victim, survivor: {running}") from None
        assert not any(s.finish for s in streams)
        os.kill(c.node_pid(victim), signal.SIGKILL)
        done = [f.result(timeout=600) for f in futures]
    for i, s in enumerate(done):
        assert s.error is None, f"stream {i}: {s.error!r}"
        assert s.finish == "length" and s.usage.completion_tokens == max_tokens
        assert "".join(s.pieces) == texts[i], f"stream {i} differs from an undisturbed run"


def idle(urls: list[str]) -> bool:
    return all(get_json(u + "/health")["in_use_blocks"] == 0 for u in urls)


def test_no_move_past_the_migration_limit(tiny_model_dir):
    """``router.migration_limit: 0``: a stream whose decode node dies ends with 503, as before migration."""
    with Cluster(tiny_model_dir, prefill=1, decode=2, overrides={"router": {"migration_limit": 0}}) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=120)
        s = Stream(client, [5, 6, 7], {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}})
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(s)
            assert s.started.wait(60)
            victim = next(u for u in c.decode_urls if get_json(u + "/health")["running"] > 0)
            os.kill(c.node_pid(victim), signal.SIGKILL)
            fut.result(timeout=120)
        assert s.finish is None and "router.migration_limit=0" in str(s.error)
        assert metrics(c.url)['kvrelay_router_migrations_total{outcome="limit"}'] == 1
        survivor = next(u for u in c.decode_urls if u != victim)
        wait_for(lambda: idle([*c.prefill_urls, survivor]), what="every block given back")


def test_a_prefill_node_that_dies_before_its_kv_is_pulled_costs_a_recompute(tiny_model_dir, tmp_path):
    """The prefill node answered (first token, KV handle) and died before the decode node pulled: the decode
    node's pull fails and it recomputes the prompt; the client gets the undisturbed run's tokens."""
    hold = tmp_path / "hold"
    hooks = os.path.join(os.path.dirname(__file__), "hooks")
    env = {"KVRELAY_TEST_HOLD_PULLS": str(hold), "PYTHONPATH": os.pathsep.join(
        [hooks, *filter(None, [os.environ.get("PYTHONPATH")])])}
    prompt = list(range(3, 3 + 40))
    expected = reference(tiny_model_dir, [prompt], [SamplingParams(max_tokens=24, temperature=0)])[0]
    with Cluster(tiny_model_dir, prefill=1, decode=1, env=env,
                 overrides={"decode": {"transfer_timeout_s": 10}}) as c:
        (prefill,), (decode,) = c.prefill_urls, c.decode_urls
        hold.touch()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, c.url, {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0})
            wait_for(lambda: os.path.exists(str(hold) + ".seen"), what="the decode node holding the pull")
            os.kill(c.node_pid(prefill), signal.SIGKILL)
            hold.unlink()
            code, body = fut.result(timeout=120)
        assert code == 200, body
        assert body["choices"][0]["text"] == load_tokenizer(tiny_model_dir).decode(expected)
        m = metrics(decode)
        assert sum(v for k, v in m.items() if k.startswith("kvrelay_kv_transfer_failures_total{")) == 1
        assert m.get("kvrelay_kv_transfer_bytes_total", 0.0) == 0
        wait_for(lambda: idle([decode]), what="the decode node's blocks given back")
