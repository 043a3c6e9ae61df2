"""Issue 32: structured outputs through real processes — SmolLM2-135M-Instruct, 1 prefill + 1 decode node, every
prompt prefilled on the prefill node (its first token sampled there under the grammar, the rest on the decode node,
which replays that token into its own matcher), asked through the official client.

Every output of a JSON schema parses and validates (50 schemas at once, then n = 2 streamed), regexes and choices
match exactly, a seeded or greedy constrained request gives the tokens of one in-process engine, and constraints
that cannot be served are 400s naming the field, after which the nodes hold no blocks and still serve.
"""

from __future__ import annotations

import json
import random
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from kvrelay.model.sampling_params import SamplingParams
from kvrelay.model.structured import StructuredOutput

from tests.real_model import RealModel
from tests.services.cluster import Cluster, get_json, metrics
from tests.services.test_faults import pools_idle, wait_for

MODEL = "smollm2-135m-instruct"
WORDS = ["red", "green", "blue", "cat", "dog", "north", "south", "small", "large", "yes", "maybe", "café", "日本"]
NAMES = ["id", "name", "title", "color", "size", "count", "tags", "owner", "active", "score", "kind", "notes"]
HAND_WRITTEN: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 120}}, "required": ["name", "email", "age"]},
    {"type": "object", "properties": {
        "sku": {"const": "A-1"},
        "dims": {"type": "object", "additionalProperties": False, "required": ["w", "h"], "properties": {
            "w": {"type": "integer", "minimum": 1, "maximum": 500}, "h": {"type": "integer", "minimum": 1,
                                                                         "maximum": 500}}},
        "price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["sku", "dims", "price"]},
    {"type": "object", "required": ["todo"], "properties": {"todo": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "required": ["title", "done"],
            "properties": {"title": {"type": "string", "maxLength": 10}, "done": {"type": "boolean"}}}}}},
    {"type": "object", "required": ["answer", "date"], "properties": {
        "answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none", "many"]}]},
        "date": {"type": "string", "format": "date"}}},
    {"type": "object", "required": ["pair"], "properties": {"pair": {
        "type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}],
        "items": False}}},
]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema whose every output is bounded (integers with bounds, strings with maxLength, arrays with
    maxItems, nesting at most 2 deep), so a small model always finishes."""
    names = rng.sample(NAMES, rng.randint(1, 4 if depth == 0 else 2))
    schema: dict[str, Any] = {"type": "object", "properties": {n: random_value(rng, depth) for n in names}}
    required = [n for n in names if rng.random() < 0.75]
    if required:
        schema["required"] = required
    return schema


def random_value(rng: random.Random, depth: int, *, in_array: bool = False) -> dict[str, Any]:
    kinds = ["integer", "boolean", "enum", "string"] + ([] if in_array else ["array"]) + (
        ["object"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 2000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(2, 12)} | ({"minLength": 1} if rng.random() < 0.5
                                                                        else {})
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_value(rng, depth + 1, in_array=True), "minItems": low,
                "maxItems": low + rng.randint(0, 1) or 1}
    return random_schema(rng, depth + 1)


def max_bytes(schema: Any) -> int:
    """An upper bound of the UTF-8 bytes of any compact output of ``schema`` (a token holds at least one byte),
    for the schemas above."""
    if schema is False:
        return 0
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return max(len(json.dumps(v, ensure_ascii=False).encode()) for v in values)
    if "anyOf" in schema:
        return max(max_bytes(s) for s in schema["anyOf"])
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    out = 0
    for kind in kinds:
        if kind in ("integer", "number"):
            out = max(out, 1 + max(len(str(schema["minimum"])), len(str(schema["maximum"]))) + (
                8 if kind == "number" else 0))
        elif kind in ("boolean", "null"):
            out = max(out, 5)
        elif kind == "string":
            chars = schema.get("maxLength", 32 if "pattern" in schema or "format" in schema else None)
            assert chars is not None, "an unbounded string"
            out = max(out, 2 + 4 * chars)
        elif kind == "array":
            items = schema.get("prefixItems", []) + [schema["items"]] * schema.get("maxItems", 0)
            out = max(out, 2 + sum(max_bytes(s) + 2 for s in items))
        else:
            out = max(out, 2 + sum(len(n) + 6 + max_bytes(s) for n, s in schema["properties"].items()))
    return out


def schemas() -> list[dict[str, Any]]:
    """The hand-written schemas and random ones up to 50, all different."""
    rng = random.Random(32)
    seen = {json.dumps(s, sort_keys=True): s for s in HAND_WRITTEN}
    while len(seen) < 50:
        schema = random_schema(rng)
        seen.setdefault(json.dumps(schema, sort_keys=True), schema)
    return list(seen.values())


def request_of(i: int, schema: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Reply with a JSON object, example {i}."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}},
            "max_tokens": max_bytes(schema) + 1, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(smollm2: RealModel):
    overrides = {"model": {"name": MODEL, "dtype": "float32"},
                 # 50 new schemas at once from one tenant (no API keys): past the default 16
                 "router": {"disaggregation": "always", "request_timeout_s": 240,
                            "max_compiling_requests_per_tenant": 64},
                 "kvstore": {"device": {"bytes": "512MiB"}}, "engine": {"max_num_seqs": 64}}
    with Cluster(smollm2.model_dir, overrides=overrides) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=240)


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def disaggregated(url: str) -> int:
    return int(metrics(url).get('kvrelay_router_plans_total{plan="disaggregated"}', 0))


def test_fifty_json_schemas_at_once_all_validate(cluster: Cluster, client: openai.OpenAI) -> None:
    all_schemas = schemas()
    assert len({json.dumps(s, sort_keys=True) for s in all_schemas}) == 50
    before = disaggregated(cluster.url)

    def ask(i: int) -> tuple[str | None, str | None]:
        body = request_of(i, all_schemas[i])
        out = client.chat.completions.create(model=MODEL, messages=body["messages"],
                                             response_format=body["response_format"],
                                             max_tokens=body["max_tokens"], temperature=0)
        return out.choices[0].message.content, out.choices[0].finish_reason

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(ask, range(50)))
    for i, ((text, reason), schema) in enumerate(zip(results, all_schemas, strict=True)):
        assert reason == "stop", (i, text, schema)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert list(value) == [name for name in schema["properties"] if name in value], text  # the schema's order
    assert disaggregated(cluster.url) - before == 50  # every one prefilled on the prefill node


def test_two_streamed_samples_per_schema_validate(client: openai.OpenAI) -> None:
    chosen = schemas()[::5]

    def ask(i: int) -> tuple[dict[int, str], dict[int, str | None]]:
        body = request_of(i, chosen[i])
        stream = client.chat.completions.create(model=MODEL, messages=body["messages"],
                                                response_format=body["response_format"],
                                                max_tokens=body["max_tokens"], temperature=0.8, seed=100 + i, n=2,
                                                stream=True)
        texts: dict[int, str] = {0: "", 1: ""}
        reasons: dict[int, str | None] = {0: None, 1: None}
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        return texts, reasons

    with ThreadPoolExecutor(len(chosen)) as pool:
        results = list(pool.map(ask, range(len(chosen))))
    for (texts, reasons), schema in zip(results, chosen, strict=True):
        assert reasons == {0: "stop", 1: "stop"}, texts
        for text in texts.values():
            jsonschema.validate(json.loads(text), schema)


def test_regexes_and_choices_match_exactly(client: openai.OpenAI) -> None:
    cases = [
        ("Write a phone number.", {"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, r"\d{3}-\d{4}"),
        ("When was the moon landing?", {"guided_regex": r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"},
         r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"),
        ("Spell a short word in capitals.", {"structured_outputs": {"regex": "[A-Z]{2,6}"}}, "[A-Z]{2,6}"),
    ]
    choices = [
        ("Is the sky blue?", {"guided_choice": ["yes", "no"]}, ["yes", "no"]),
        ("Pick a color.", {"structured_outputs": {"choice": ["red", "green", "blue"]}}, ["red", "green", "blue"]),
        ("How do you feel?", {"structured_outputs": {"choice": ["😀", "🙁", "café au lait"]}},
         ["😀", "🙁", "café au lait"]),
    ]

    def ask(question: str, extra: dict[str, Any], temperature: float) -> tuple[str | None, str | None]:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                             max_tokens=24, temperature=temperature, seed=5, extra_body=extra)
        return out.choices[0].message.content, out.choices[0].finish_reason

    for temperature in (0.0, 1.0):
        for question, extra, pattern in cases:
            text, reason = ask(question, extra, temperature)
            assert reason == "stop" and re.fullmatch(pattern, text or ""), (question, text)
        for question, extra, allowed in choices:
            text, reason = ask(question, extra, temperature)
            assert reason == "stop" and text in allowed, (question, text)
    json_object = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object with two keys."}], max_tokens=200,
        temperature=0, response_format={"type": "json_object"})
    assert json_object.choices[0].finish_reason in ("stop", "length")
    if json_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(json_object.choices[0].message.content), dict)


def test_first_token_on_prefill_rest_on_decode_equals_one_engine(cluster: Cluster, smollm2: RealModel) -> None:
    """The grammar-state handoff: the prefill node samples the first token under the grammar, the decode node
    rebuilds the matcher from it; seeded and greedy samples equal the in-process engine's, token for token."""
    from kvrelay import LLM

    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks pulled from the prefill node
    person = {"type": "object", "required": ["name", "age", "pets"], "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog", "fish"]}}}}
    constraints = [("guided_json", person, StructuredOutput("json", json.dumps(person, separators=(",", ":")))),
                   ("guided_regex", r"[a-z]{3,9}( [a-z]{3,9}){2}", StructuredOutput("regex",
                                                                                   r"[a-z]{3,9}( [a-z]{3,9}){2}"))]
    requests = [(field, value, out, temperature, seed) for field, value, out in constraints
                for temperature, seed in ((0.0, None), (0.8, 11), (0.8, 12))]
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 128, "temperature": t, "seed": s, field: value,
               "logprobs": 0, "return_tokens_as_token_ids": True} for field, value, _, t, s in requests]
    pulled = metrics(cluster.decode_urls[0]).get("kvrelay_kv_transfer_bytes_total", 0.0)
    with ThreadPoolExecutor(len(bodies)) as pool:
        served = list(pool.map(lambda body: post(cluster.url, "/v1/completions", body), bodies))
    assert metrics(cluster.decode_urls[0]).get("kvrelay_kv_transfer_bytes_total", 0.0) > pulled
    llm = LLM(smollm2.model_dir, dtype="float32", kv_cache_memory="128MiB")
    try:
        want = llm.generate([prompt] * len(requests), [
            SamplingParams(max_tokens=128, temperature=t, seed=s, structured_outputs=out)
            for _, _, out, t, s in requests], use_tqdm=False)
    finally:
        llm.close()
    for (code, body), ref, req in zip(served, want, requests, strict=True):
        assert code == 200, body
        [choice] = body["choices"]
        [sample] = ref.outputs
        assert (choice["text"], choice["finish_reason"]) == (sample.text, sample.finish_reason), req
        assert sample.finish_reason == "stop" and sample.token_ids[-1] in llm.engine.eos_token_ids
        served_ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        assert served_ids == sample.token_ids[:len(served_ids)] and len(served_ids) >= len(sample.token_ids) - 1, req
        assert body["usage"]["completion_tokens"] == len(sample.token_ids), req


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema", "response_format.json_schema.schema is not a valid JSON schema: "
                                               "'nonsense' is not valid under any of the given schemas (at type)"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex",
         "structured_outputs.regex is not a valid regular expression: missing ), unterminated subpattern at "
         "position 0"),
        # refused by the node, which compiles them: the router names the field
        ({"structured_outputs": {"grammar": "root ::= item\nitem ::= missing"}}, "structured_outputs.grammar",
         "structured output: the grammar constraint does not compile: EBNF parser error at line 2, column 10: Rule "
         '"missing" is not defined'),
        ({"guided_regex": "(?=a)a"}, "guided_regex", "structured output: the regex constraint does not compile: "
                                                     "Regex parsing error at position 3: Lookahead is not supported "
                                                     "yet."),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice",
         "one constraint per request: got structured_outputs, guided_choice"),
    ],
)
def test_constraints_that_cannot_be_served_are_400s_naming_the_field(cluster: Cluster, extra, param, message):
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        code, body = post(cluster.url, path, {"model": MODEL, "max_tokens": 8, **base, **extra})
        assert (code, body["error"]["param"], body["error"]["message"]) == (400, param, message), path


def test_edge_cases_end_cleanly_and_the_nodes_hold_no_blocks(cluster: Cluster, client: openai.OpenAI) -> None:
    """After refusals, a sample cut mid-JSON, min_tokens past the grammar's end (it crashed the engine step of a
    sampled request: a row of -inf) and top_logprobs over a grammar (masked tokens were listed at -inf, written as
    -Infinity: no JSON), both nodes still serve and hold no blocks."""
    bad = {"model": MODEL, "prompt": list(range(1000, 1040)), "max_tokens": 8,
           "structured_outputs": {"grammar": "root ::= nope"}}
    for _ in range(3):
        assert post(cluster.url, "/v1/completions", bad)[0] == 400
    short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person."}],
                                           max_tokens=3, temperature=0, response_format={
                                               "type": "json_schema", "json_schema": {"name": "p", "schema": {
                                                   "type": "object", "properties": {"name": {"type": "string"}},
                                                   "required": ["name"]}}})
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    for temperature in (0.0, 1.0):
        held = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is ice cold?"}],
                                              max_tokens=12, temperature=temperature, seed=1,
                                              extra_body={"guided_choice": ["yes", "no"], "min_tokens": 8})
        assert held.choices[0].message.content in ("yes", "no") and held.choices[0].finish_reason == "stop"
    req = urllib.request.Request(cluster.url + "/v1/chat/completions", method="POST", data=json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Is fire hot?"}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 5, "guided_choice": ["yes", "no"]}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()
    body = json.loads(raw, parse_constant=lambda name: pytest.fail(f"{name} in a JSON body: {raw}"))
    [choice] = body["choices"]
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
    first, *rest = choice["logprobs"]["content"]
    assert {t["token"] for t in first["top_logprobs"]} <= {"yes", "no", "y", "n", "ye"}, first
    assert all(len(t["top_logprobs"]) == 1 for t in rest), rest  # one token allowed: no alternatives
    wait_for(lambda: pools_idle(cluster), what="both pools back to no blocks in use")
    assert get_json(cluster.prefill_urls[0] + "/health")["leases"] == 0
    for url in cluster.prefill_urls + cluster.decode_urls:
        health = get_json(url + "/health")
        assert (health["status"], health["running"], health["in_use_blocks"]) == ("ok", 0, 0), url
