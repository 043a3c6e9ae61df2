"""The request fields that constrain an output, read into one `StructuredOutput`.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``strict``), vLLM's
``structured_outputs: {json | regex | choice | grammar | json_object}`` and its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one of them may constrain a request. The router
checks what it can without loading the grammar library (`check_compiles`); the nodes compile the constraint against
the vocabulary (`engine.grammar`) and answer 400 for one that does not compile, which the router passes on naming
the field (`GenerationRequest.structured_param`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from kvrelay.model.structured import MAX_SPEC_CHARS, StructuredOutput

GUIDED_FIELD_TO_KIND = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                        "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs keys vLLM accepts that change nothing here (the nodes never offer free whitespace in JSON:
# `engine.grammar`)
MAX_SCHEMA_DEPTH = 32  # nesting levels of a schema's JSON (objects and lists)
IGNORED_STRUCTURED_KEYS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                           "whitespace_pattern", "backend")


class StructuredError(ValueError):
    """A constraint field that cannot be served; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_from_body(body: dict[str, Any]) -> tuple[StructuredOutput | None, str | None]:
    """The constraint a request body asks for and the field it came from, as a 400 about it names it
    (``response_format.json_schema.schema``, ``structured_outputs.grammar``, ``guided_regex``), or (None, None).

    Raises:
        StructuredError: a field of the wrong shape, or several fields constraining the request.
    """
    found: list[tuple[StructuredOutput, str]] = []
    rf = body.get("response_format")
    if rf is not None:
        out = _response_format(rf)
        if out is not None:
            found.append((out, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        found.append((_structured_outputs(so), "structured_outputs"))
    for name, kind in GUIDED_FIELD_TO_KIND.items():
        if body.get(name) is not None:
            found.append((_one(kind, body[name], name), name))
    if body.get("guided_json_object") is not None:
        raise StructuredError("guided_json_object is not a field; use response_format: {\"type\": \"json_object\"}",
                              "guided_json_object")
    if len(found) > 1:
        names = ", ".join(name for _, name in found)
        raise StructuredError(f"one constraint per request: got {names}", found[1][1])
    if not found:
        return None, None
    out, name = found[0]
    return out, _param(name, out)


def _param(field: str, out: StructuredOutput) -> str:
    """The part of request field ``field`` that ``out`` was read from."""
    if field == "structured_outputs":
        return f"structured_outputs.{out.kind}"  # its keys are the kinds
    if field == "response_format" and out.kind == "json":
        return "response_format.json_schema.schema"
    return field


def _response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise StructuredError("response_format must be an object with a string type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise StructuredError("response_format.json_schema must be an object with a schema",
                                  "response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, dict):
            raise StructuredError("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format.json_schema.schema")
        strict = js.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise StructuredError("response_format.json_schema.strict must be a boolean",
                                  "response_format.json_schema.strict")
        return _one("json", schema, "response_format.json_schema.schema", strict=bool(strict))
    raise StructuredError(f"response_format.type must be text, json_object or json_schema, got {kind[:40]!r}",
                          "response_format.type")


def _structured_outputs(so: Any) -> StructuredOutput:
    if not isinstance(so, dict):
        raise StructuredError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(so) - set(STRUCTURED_KEYS) - set(IGNORED_STRUCTURED_KEYS))
    if unknown:
        raise StructuredError(f"structured_outputs: unknown field {unknown[0][:40]!r}; it takes one of "
                              f"{', '.join(STRUCTURED_KEYS)}", f"structured_outputs.{unknown[0][:40]}")
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise StructuredError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}, got "
                              f"{len(given)}", "structured_outputs")
    key = given[0]
    if key == "json_object":
        if so[key] is not True:
            raise StructuredError("structured_outputs.json_object must be true", "structured_outputs.json_object")
        return StructuredOutput("json_object")
    return _one(key, so[key], f"structured_outputs.{key}")


def _one(kind: str, value: Any, param: str, *, strict: bool = False) -> StructuredOutput:
    """One constraint of ``kind`` from a request value (a schema as an object or JSON text, a string, choices)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise StructuredError(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise StructuredError(f"{param} must be a JSON schema object", param)
        check_depth(value, param, StructuredError)
        spec = json.dumps(value, separators=(",", ":"))  # key order kept: properties come out in it
        return _build(StructuredOutput, param, "json", spec, strict=strict)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise StructuredError(f"{param} must be a list of strings", param)
        return _build(StructuredOutput, param, "choice", choices=tuple(value))
    if not isinstance(value, str):
        raise StructuredError(f"{param} must be a string", param)
    return _build(StructuredOutput, param, kind, value)


def _build(cls: type[StructuredOutput], param: str, *args: Any, **kwargs: Any) -> StructuredOutput:
    if len(args) > 1 and isinstance(args[1], str) and len(args[1]) > MAX_SPEC_CHARS:
        raise StructuredError(f"{param} is over {MAX_SPEC_CHARS} characters", param)
    try:
        return cls(*args, **kwargs)
    except ValueError as exc:
        raise StructuredError(f"{param}: {exc}", param) from None


def check_compiles(out: StructuredOutput, param: str) -> None:
    """What can be checked without the grammar library (the router loads no torch, and xgrammar does): a JSON
    schema against its metaschema (`jsonschema`), a regex with Python's ``re``. The node compiles the constraint
    (`engine.grammar`) and refuses what xgrammar cannot convert with a 400 the router passes on naming ``param``.

    Raises:
        StructuredError: the schema or regex is malformed, with the reason.
    """
    problem = _problem(out, param)
    if problem is not None:
        raise StructuredError(problem, param)


@functools.lru_cache(maxsize=256)  # a /v1/completions request checks its constraint once per prompt
def _problem(out: StructuredOutput, param: str) -> str | None:
    try:
        if out.kind == "json":
            check_schema(json.loads(out.spec), param, StructuredError)
        elif out.kind == "regex":
            try:
                re.compile(out.spec)
            except (re.error, RecursionError, OverflowError, ValueError) as exc:
                raise StructuredError(f"{param} is not a valid regular expression: {exc}", param) from None
    except StructuredError as exc:
        return str(exc)
    return None


def check_depth(value: Any, param: str, error: type[Exception]) -> None:
    """Raise ``error(message, param)`` when the JSON ``value`` nests deeper than `MAX_SCHEMA_DEPTH` (a schema that
    deep serves no one; checkers and compilers recurse on it)."""
    level = [value]
    for _ in range(MAX_SCHEMA_DEPTH):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
        if not level:
            return
    raise error(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)


def check_schema(schema: Any, param: str, error: type[Exception]) -> None:
    """Raise ``error(message, param)`` unless ``schema`` is a JSON schema object its metaschema accepts (and
    nested at most `MAX_SCHEMA_DEPTH` deep)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise error(f"{param} must be a JSON schema object", param)
    check_depth(schema, param, error)
    if not isinstance(schema.get("$schema", ""), str):
        raise error(f"{param}: $schema must be a string", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise error(f"{param} is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else ""),
                    param) from None
    except (RecursionError, ValueError, TypeError, AttributeError) as exc:
        raise error(f"{param} is not a valid JSON schema: {exc}", param) from None
