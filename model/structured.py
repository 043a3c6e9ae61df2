"""`StructuredOutput`: what a request's output must match (a JSON schema, any JSON, a regex, one of some strings, or
an EBNF grammar). No torch, no grammar library: the router builds these and they cross the wire inside
`SamplingParams`; `engine.grammar` compiles them into token masks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar of more is refused (it is compiled on every node)
MAX_CHOICES = 256
KINDS = ("json", "json_object", "regex", "choice", "grammar")
GRAMMAR_ERROR_PREFIX = "structured output: "  # starts a node's 400 for a constraint it cannot compile


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The constraint on one request's output.

    ``kind``:

    * ``json``: ``spec`` is a JSON schema (JSON text). Every schema is enforced as OpenAI's ``strict: true``
      asks (as vLLM does, whatever ``strict`` says): no property the schema does not name is generated.
    * ``json_object``: any JSON object (``spec`` is empty).
    * ``regex``: ``spec`` is a regular expression the whole output matches.
    * ``choice``: ``choices`` are the outputs allowed (``spec`` is empty).
    * ``grammar``: ``spec`` is an EBNF grammar (GBNF, as llama.cpp and xgrammar read it) whose ``root`` rule the
      output matches.

    Raises:
        ValueError: an unknown kind, a spec or choice list of the wrong shape or over the limits, or a ``json``
            spec that is not a JSON object, naming which.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = False
    # In-process only, never on the wire: the grammar a node compiled for it off the engine thread
    # (`node.app` read_request), so the engine never compiles it again on its thread (`engine.grammar`).
    compiled: Any = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"a {self.kind} spec must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind in ("json", "regex", "grammar") and not self.spec:
            raise ValueError(f"a {self.kind} constraint needs a non-empty spec")
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise ValueError(f"choice takes 1 to {MAX_CHOICES} strings, got {len(self.choices)}")
            if not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("every choice must be a non-empty string")
            if sum(len(c) for c in self.choices) > MAX_SPEC_CHARS:
                raise ValueError(f"the choices are over {MAX_SPEC_CHARS} characters in all")
        elif self.choices:
            raise ValueError(f"choices belong to kind 'choice', not {self.kind!r}")

    @property
    def cache_key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the compiled grammar (``strict`` does not: every schema compiles strictly)."""
        return (self.kind, self.spec, self.choices)

    def to_wire(self) -> dict[str, object]:
        return {"kind": self.kind, "spec": self.spec, "choices": list(self.choices), "strict": self.strict}

    @classmethod
    def from_wire(cls, value: object) -> StructuredOutput:
        """Raises ValueError for a map of the wrong shape (or one `StructuredOutput` refuses)."""
        if not isinstance(value, dict) or set(value) - {"kind", "spec", "choices", "strict"}:
            raise ValueError("structured output: expected a map of kind, spec, choices, strict")
        kind, spec, choices, strict = (value.get("kind"), value.get("spec", ""), value.get("choices", []),
                                       value.get("strict", False))
        if not isinstance(kind, str) or not isinstance(spec, str) or not isinstance(strict, bool) \
                or not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("structured output: a field has the wrong type")
        return cls(kind, spec, tuple(choices), strict)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's offline spelling: exactly one of ``json`` (a schema, as a dict or JSON text), ``regex``, ``choice``,
    ``grammar`` (EBNF) or ``json_object=True``. `SamplingParams` turns it into a `StructuredOutput`.

    Raises:
        ValueError: none or several given, or a value `StructuredOutput` refuses.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_structured(self) -> StructuredOutput:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {len(given)}")
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json, separators=(",", ":"))
            return StructuredOutput("json", spec)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", choices=tuple(self.choice))
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        return StructuredOutput("json_object")
