"""KV integrity through `kvrelay up` (issue 16): a prefill node damages the blocks it has just offered —
one flipped bit after the handle was given out, or every leased block overwritten as if the lease had
quietly ended and the slots were reused before the READ — and the decode node must catch it by the
handle's digests, count it at ``where="nixl_read"``, recompute and serve the reference tokens. With
``kvstore.integrity: off`` the same damage is served (the test can fail)."""

from __future__ import annotations

import random

import pytest

from engine.engine import EngineConfig, LLMEngine
from model.loader import load_model
from model.sampling import SamplingParams
from model.tokenizer import load_tokenizer
from tests.services.cluster import Cluster, metrics
from tests.services.test_faults import pools_idle, post, wait_for

PROMPT = [random.Random(16).randrange(256) for _ in range(100)]  # 6 full blocks + a 4-token tail
NUM_BLOCKS = 6


@pytest.fixture(scope="module")
def reference_text(tiny_model_dir) -> str:
    engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(num_blocks=64))
    [[want]] = engine.generate([PROMPT], SamplingParams(max_tokens=12))
    return load_tokenizer(tiny_model_dir).decode(want)


@pytest.mark.parametrize("fault, integrity, failures", [
    ("corrupt_published_block", "all", 1),
    ("overwrite_leased_blocks", "all", NUM_BLOCKS),
    ("corrupt_published_block", "off", 0),
    ("overwrite_leased_blocks", "off", 0),
])
def test_damaged_kv_read_over_nixl_is_recomputed_not_served(tiny_model_dir, reference_text, fault, integrity,
                                                            failures):
    overrides = {"prefill": {"inject_faults": [fault]}, "kvstore": {"integrity": integrity}}
    with Cluster(tiny_model_dir, overrides=overrides) as c:
        code, out = post(c.url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert code == 200, out
        m = metrics(c.decode_urls[0])
        assert m.get('kvrelay_kv_integrity_failures_total{where="nixl_read"}', 0.0) == failures
        assert m.get("kvrelay_kv_transfer_bytes_total", 0.0) > 0  # the blocks did travel over NIXL
        assert m.get('kvrelay_kv_integrity_checks_total{where="nixl_read"}', 0.0) == (
            NUM_BLOCKS if integrity == "all" else 0)
        wait_for(lambda: pools_idle(c), what="pools back to baseline")
    served_reference = out["choices"][0]["text"] == reference_text
    assert served_reference == (integrity == "all")  # off: the damaged KV was used
