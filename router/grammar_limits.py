"""The router's bounds on an EBNF grammar (``structured_outputs.grammar``, ``guided_grammar``), checked before any
node compiles it: its size in bytes, how deep its parentheses nest, how many rules and alternatives it has.

Every node compiles a grammar that reaches it: a chain of 3,000 one-literal rules takes 0.57 s and 4.5 MB
(xgrammar 0.2.9, SmolLM2's vocabulary; the table in `docs/reference/http-api.md`). Grammars people write have
tens of rules and nest a few levels; the defaults sit an order of magnitude above that and below what costs a
node a second. Shape does not bound compile time (``[a-z]*`` written 1,600 times: 11 KB, 16 s): the nodes' compile
deadline does (`engine.grammar_check`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.router.structured_api import StructuredError


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds on one EBNF grammar (``router.max_grammar_*``)."""

    max_bytes: int = 32 * 1024
    max_nesting: int = 64  # parentheses within parentheses (Dynamo refuses past 500; xgrammar fails near 1,000)
    max_rules: int = 500
    max_alternatives: int = 2000  # ``|`` in the whole grammar


@dataclass(frozen=True, slots=True)
class GrammarShape:
    """What `shape_of` counts: outside string literals, character classes and comments."""

    nesting: int
    rules: int
    alternatives: int


def shape_of(spec: str) -> GrammarShape:
    """Count an EBNF (GBNF) grammar's deepest parenthesis nesting, its rules (``::=``) and its alternatives (``|``).
    One pass; a grammar that does not parse is counted as far as it goes (the node's compile says what is wrong)."""
    depth = deepest = rules = alternatives = 0
    i, n = 0, len(spec)
    while i < n:
        c = spec[i]
        if c in "\"[":  # a string literal or a character class, with backslash escapes
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and spec[i] != close:
                i += 2 if spec[i] == "\\" else 1
        elif c == "#":
            while i < n and spec[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == "|":
            alternatives += 1
        elif c == ":" and spec.startswith("::=", i):
            rules += 1
            i += 2
        i += 1
    return GrammarShape(deepest, rules, alternatives)


def check_grammar(spec: str, param: str, limits: GrammarLimits) -> None:
    """Raise `StructuredError` naming ``param`` and the limit the grammar ``spec`` passes, if any."""
    size = len(spec.encode())
    if size > limits.max_bytes:
        raise StructuredError(f"{param} is {size} bytes, over the limit of {limits.max_bytes} "
                              "(router.max_grammar_bytes)", param)
    shape = shape_of(spec)
    for count, limit, what, key in ((shape.nesting, limits.max_nesting, "levels of parentheses", "nesting"),
                                    (shape.rules, limits.max_rules, "rules", "rules"),
                                    (shape.alternatives, limits.max_alternatives, "alternatives (|)",
                                     "alternatives")):
        if count > limit:
            raise StructuredError(f"{param} has {count} {what}, over the limit of {limit} "
                                  f"(router.max_grammar_{key})", param)
