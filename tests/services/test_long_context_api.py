"""Long-context policies through `kvrelay up`: the deployment default and the API's per-request override."""

from __future__ import annotations

import random

from kvrelay.engine.engine import EngineConfig, LLMEngine
from kvrelay.engine.long_context import LongContextConfig
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.model.loader import load_model
from kvrelay.model.sampling import SamplingParams
from kvrelay.model.tokenizer import load_tokenizer

from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_faults import post, wait_for

H2O = {"policy": "h2o", "device_budget_tokens": 64, "sink_tokens": 16, "recent_tokens": 16}
INFINIGEN = {"policy": "infinigen", "device_budget_tokens": 96, "sink_tokens": 16, "recent_tokens": 32,
             "recall_blocks": 2}


def test_policies_per_deployment_and_per_request(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    rng = random.Random(8)
    prompt = [rng.randrange(256) for _ in range(130)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def local(policy: dict | None) -> list[int]:
        """What the decode node computes: the prompt's full blocks already cached (pulled), the tail and the
        first token (sampled by prefill) computed with full attention, then decode under the policy."""
        cfg = LongContextConfig(**policy) if policy else LongContextConfig()
        eng = LLMEngine(loaded, EngineConfig(num_blocks=64),
                        store_config=TieredStoreConfig(num_device_blocks=64, num_host_blocks=32, watermark_blocks=0))
        [[first]] = eng.generate([prompt], SamplingParams(max_tokens=1))
        eng.add_request("r", prompt, params, first_token_ids=first, long_context=cfg)
        out = list(first)
        while eng.has_unfinished():
            out += [t for o in eng.step() for t in o.new_token_ids]
        return out

    want = {"none": local(None), "h2o": local(H2O), "infinigen": local(INFINIGEN)}
    # the deployment's default is h2o; requests override it
    with Cluster(tiny_model_dir, overrides={"decode": {"long_context": H2O}}) as c:
        decode, prefill = c.decode_urls[0], c.prefill_urls[0]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}

        code, out = post(c.url, body)
        assert code == 200 and out["usage"]["completion_tokens"] == 16
        lc = get_json(decode + "/health")["long_context"]
        assert lc["evicted_tokens"] > 0 and lc["offloaded_blocks"] == 0
        code, out_ig = post(c.url, {**body, "kvrelay": {"long_context": {**INFINIGEN}}})
        assert code == 200
        lc = get_json(decode + "/health")["long_context"]
        assert lc["offloaded_blocks"] > 0 and lc["recalled_layer_blocks"] > 0
        code, out_full = post(c.url, {**body, "kvrelay": {"long_context": {"policy": "none"}}})
        assert code == 200
        texts = {k: o["choices"][0]["text"] for k, o in (("h2o", out), ("infinigen", out_ig), ("none", out_full))}
        tok = load_tokenizer(tiny_model_dir)
        assert texts == {k: tok.decode(v) for k, v in want.items()}

        prefills = metrics(prefill)['kvrelay_requests_total{role="prefill",status="ok"}']
        code, err = post(c.url, {**body, "kvrelay": {"long_context": {"device_budget_tokens": 32}}})
        assert code == 400 and "raise device_budget_tokens to at least 48" in err["error"]["message"]
        code, err = post(c.url, {**body, "stream": True, "kvrelay": {"long_context": {"device_budget_tokens": 32}}})
        assert code == 400 and "raise device_budget_tokens to at least 48" in err["error"]["message"]
        code, err = post(c.url, {**body, "kvrelay": {"long_context": {"device_budget_tokens": 10**30}}})
        assert code == 400 and "kvrelay.long_context.device_budget_tokens: must be an integer in [0, 2**31)" in \
            err["error"]["message"]
        code, err = post(c.url, {**body, "kvrelay": {"long_context": {"budget": 32}}})
        assert code == 400 and "kvrelay.long_context: unknown field 'budget'" in err["error"]["message"]
        code, err = post(c.url, {**body, "kvrelay": {"long_context": {"policy": "lru"}}})
        assert code == 400 and "kvrelay.long_context.policy: 'lru' is not one of" in err["error"]["message"]
        code, err = post(c.url, {**body, "kvrelay": {"cache": 1}})
        assert code == 400 and "unknown field 'cache'" in err["error"]["message"]
        # refused by the router before any prefill: no KV computed or leased for them
        assert metrics(prefill)['kvrelay_requests_total{role="prefill",status="ok"}'] == prefills
        wait_for(lambda: all(get_json(u + "/health")["in_use_blocks"] == 0 for u in (decode, prefill)),
                 what="leases released and pools idle")
        assert get_json(decode + "/health")["host_reserved_blocks"] == 0
