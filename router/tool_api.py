"""A chat request's ``tools`` and ``tool_choice``, and the tool parts of its messages, read as vLLM reads them.

* ``tools``: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``, rendered by the chat
  template (also with ``tool_choice: "none"``).
* ``tool_choice``: ``none`` (plain content), ``auto`` (the default with tools: a parser finds calls in the text;
  needs the server's ``--enable-auto-tool-choice``, as vLLM), ``required`` (a JSON schema forces an array of one
  or more ``{"name", "parameters"}``, one ``anyOf`` branch per tool) or ``{"type": "function", "function":
  {"name": f}}`` (f's parameters schema forces the text, which is the call's arguments). The schema becomes the
  request's `StructuredOutput`; the nodes compile it like any other.
* messages: an assistant message's ``tool_calls`` (its ``arguments`` JSON text made an object for the template, as
  Hugging Face templates expect) and a ``tool`` message's ``tool_call_id``.

Every refusal is a `ToolError` naming the field.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from kvrelay.model.structured import MAX_SPEC_CHARS, StructuredOutput
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.router.structured_api import check_schema
from kvrelay.router.tool_calls import PARSER_NAME_TO_MARKERS, ToolOutput

MAX_TOOLS = 128  # as OpenAI allows
MAX_TOOL_NAME_CHARS = 256
TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tools field that cannot be served; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat body's tools ask for: ``tools`` for the template (None: the body has none), how the output
    becomes calls (``output``, None: plain content) and the schema that forces it (``constraint``)."""

    tools: list[dict[str, Any]] | None
    output: ToolOutput | None
    constraint: StructuredOutput | None


def tool_plan(body: dict[str, Any], *, parser: str | None, auto_enabled: bool,
              tokenizer: Tokenizer | None) -> ToolPlan:
    """Read ``tools`` and ``tool_choice``. ``parser``: the server's tool-call parser (None: it has none);
    ``auto_enabled``: the server was started with ``--enable-auto-tool-choice``.

    Raises:
        ToolError: a malformed tool or choice, a choice naming no tool, a choice other than ``none`` without
            tools, or ``auto`` on a server that does not parse calls.
    """
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise ToolError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                        f"{{\"name\": ...}}}}, got {choice[:40]!r}", "tool_choice")
    if choice == "none":
        return ToolPlan(tools or None, None, None)
    if not tools:
        raise ToolError("tool_choice needs tools; send the functions in tools", "tool_choice")
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise ToolError('tool_choice "auto" (the default when tools are given) needs the server started with '
                            "--enable-auto-tool-choice (router.enable_auto_tool_choice: true)"
                            + ("" if parser is not None else " and --tool-call-parser (router.tool_call_parser)")
                            + '; or ask for tool_choice "required", a named function, or "none"', "tool_choice")
        return ToolPlan(tools, ToolOutput("auto", parser, keep_token_ids=_marker_ids(tokenizer, parser)), None)
    name_to_tool = {t["function"]["name"]: t for t in tools}
    if choice == "required":
        return ToolPlan(tools, ToolOutput("required"), _constraint(required_schema(tools)))
    name = _named(choice)
    if name not in name_to_tool:
        raise ToolError(f"tool_choice names function {name[:80]!r}, which is not in tools (they are "
                        f"{', '.join(sorted(name_to_tool))[:200]})", "tool_choice")
    params = name_to_tool[name]["function"].get("parameters") or EMPTY_PARAMETERS
    return ToolPlan(tools, ToolOutput("named", name=name), _constraint(params))


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: an array of 1+ calls ``{"name": <one tool's>, "parameters":
    <its schema>}``, one ``anyOf`` branch per tool; each tool's ``$defs`` moved to the root, where their
    ``#/$defs/...`` references point.

    Raises:
        ToolError: two tools define one ``$defs`` name differently.
    """
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        params = copy.deepcopy(tool["function"].get("parameters") or EMPTY_PARAMETERS)
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise ToolError(f"tools[{i}].function.parameters: $defs {name!r} differs from another tool's; "
                                "give each a name of its own", f"tools[{i}].function.parameters")
            defs[name] = schema
        branches.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if defs:
        schema["$defs"] = defs
    return schema


def _constraint(schema: dict[str, Any]) -> StructuredOutput:
    spec = json.dumps(schema, separators=(",", ":"))
    if len(spec) > MAX_SPEC_CHARS:
        raise ToolError(f"tools: the schema tool_choice needs is over {MAX_SPEC_CHARS} characters; send fewer or "
                        "smaller tools", "tools")
    return StructuredOutput("json", spec)


def _named(choice: Any) -> str:
    usage = 'use {"type": "function", "function": {"name": "my_function"}}'
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        raise ToolError(f"tool_choice must be none, auto, required or a function: {usage}", "tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolError(f"tool_choice.function.name must be a non-empty string: {usage}", "tool_choice")
    return function["name"]


def _tools(raw: Any) -> list[dict[str, Any]]:
    """The validated tools, as the template gets them (unknown keys kept, type set)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"tools takes at most {MAX_TOOLS} functions, got {len(raw)}", "tools")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(f"{where} must be an object", where)
        if tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type must be \"function\", got {str(tool.get('type'))[:40]!r}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function must be an object with a name", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_TOOL_NAME_CHARS:
            raise ToolError(f"{where}.function.name must be a non-empty string of at most {MAX_TOOL_NAME_CHARS} "
                            "characters", f"{where}.function.name")
        if name in seen:
            raise ToolError(f"{where}.function.name: {name[:80]!r} names two tools", f"{where}.function.name")
        seen.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        params = function.get("parameters")
        if params is not None:
            _check_schema(params, f"{where}.function.parameters")
        out.append({**tool, "type": "function", "function": dict(function)})
    return out


def _check_schema(schema: Any, param: str) -> None:
    check_schema(schema, param, ToolError)


def _marker_ids(tokenizer: Tokenizer | None, parser: str) -> frozenset[int]:
    """The special tokens ``parser``'s markup is, in this tokenizer (each marker one special token, or none)."""
    if tokenizer is None:
        return frozenset()
    out = set()
    for marker in PARSER_NAME_TO_MARKERS[parser]:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in tokenizer.special_ids:
            out.add(ids[0])
    return frozenset(out)


def template_message(i: int, msg: dict[str, Any], content: str | None) -> dict[str, Any]:
    """Message ``i`` as the chat template gets it: role and text content (an assistant's null content is ""), an
    assistant's ``tool_calls`` with their arguments as objects, a tool result's ``tool_call_id``, a ``name``.

    Raises:
        ToolError: malformed tool calls (param ``messages``).
    """
    role = msg["role"]
    out: dict[str, Any] = {"role": role, "content": "" if content is None else content}
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if role == "assistant" and msg.get("tool_calls") is not None:
        out["tool_calls"] = _message_tool_calls(i, msg["tool_calls"])
    if role == "tool" and msg.get("tool_call_id") is not None:
        if not isinstance(msg["tool_call_id"], str):
            raise ToolError(f"messages[{i}].tool_call_id must be a string", "messages")
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _message_tool_calls(i: int, raw: Any) -> list[dict[str, Any]]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise ToolError(f"{where} must be a list", "messages")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                            "\"arguments\"}}", "messages")
        args = function.get("arguments")
        if isinstance(args, str) and args.strip():
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as exc:
                raise ToolError(f"{where}[{j}].function.arguments is not valid JSON: {exc}", "messages") from None
        elif not args:
            args = {}
        elif not isinstance(args, (dict, list)):
            raise ToolError(f"{where}[{j}].function.arguments must be JSON text", "messages")
        out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls
