"""gpt-oss chat prompts in OpenAI's harmony format (``openai_harmony``), as vLLM renders them.

A model whose ``config.json`` says ``model_type: gpt_oss`` is prompted in harmony, not through a Jinja template, and
its output is parsed from token ids (`router.harmony_output`). A chat request becomes::

    <|start|>system<|message|>...Reasoning: {reasoning_effort}...# Valid channels: analysis[, commentary], final<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system messages}\\n\\n# Tools ...{tools}<|end|>
    {the messages: user; assistant (final channel; its calls on commentary to=functions.NAME, json); tool results
     from functions.NAME}
    <|start|>assistant

* The system message carries the request's ``reasoning_effort`` (low / medium / high; unset: harmony's default,
  medium) and today's date; ``commentary`` is a valid channel only when function tools are given (vLLM's rule).
* The request's ``system`` and ``developer`` messages become the developer message's instructions (joined by a blank
  line), as vLLM's chat endpoint does; the function ``tools`` its tool definitions. ``tool_choice: "none"`` leaves the
  tools out (vLLM); ``auto`` parses the model's calls; ``required`` and a named function are refused (their
  constraint would bind the whole harmony output, channels included).
* A ``tool`` message answers the call its ``tool_call_id`` names (or its ``name``), as ``functions.NAME``.
* Fields that configure a Jinja template (``chat_template``, ``chat_template_kwargs``, ``documents``,
  ``add_generation_prompt``, ``continue_final_message``) are refused: nothing here reads them.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay.router.harmony_vocab import ENV_DIR, default_cache_dir, encodings_dir
from kvrelay.router.reasoning import REASONING_PARSERS
from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

log = logging.getLogger(__name__)
HARMONY_MODEL_TYPES = ("gpt_oss",)
REASONING_PARSER = "openai_gptoss"  # vLLM's --reasoning-parser name for harmony
ALL_REASONING_PARSERS = (*REASONING_PARSERS, REASONING_PARSER)  # what --reasoning-parser takes
EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
HARMONY_MARKUP = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "documents", "add_generation_prompt",
                   "continue_final_message")


class HarmonyInputError(ValueError):
    """A chat request harmony cannot render; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class HarmonyPrompt:
    """A rendered chat request: the prompt's token ids, and whether function calls in the output become
    ``tool_calls`` (tools were given and tool_choice is ``auto``)."""

    token_ids: list[int]
    calls: bool


def is_harmony_model(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s ``config.json`` names a harmony family (`HARMONY_MODEL_TYPES`)."""
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return model_type in HARMONY_MODEL_TYPES


def load_encoding(encodings_dir: Path) -> HarmonyEncoding:
    """gpt-oss's harmony encoding, its vocabulary read from ``encodings_dir`` (`router.harmony_vocab`).

    openai_harmony takes the directory only from the environment (``TIKTOKEN_ENCODINGS_BASE``), so it is set here,
    for this process, before the one load.
    """
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(encodings_dir)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def served_encoding(model_dir: str | Path, *, reasoning_parser: str | None, vocab_size: int) -> HarmonyEncoding | None:
    """The harmony encoding the router serves ``model_dir`` with: gpt-oss's for a harmony family (`is_harmony_model`),
    None for any other, and for a gpt_oss model whose ``vocab_size`` cannot hold harmony's token ids (a tiny test
    model with a byte tokenizer: chat goes through its template, as for any model; a warning says so). Its
    vocabulary: `router.harmony_vocab` (``TIKTOKEN_ENCODINGS_BASE``, else the packaged copy).

    Raises:
        ValueError: ``reasoning_parser`` names a text parser for a harmony model, or `REASONING_PARSER` for another
            model (or for a gpt_oss model too small for harmony's ids).
        VocabError: no o200k_base vocabulary (the message names ``TIKTOKEN_ENCODINGS_BASE`` and the file).
    """
    if not is_harmony_model(model_dir):
        if reasoning_parser == REASONING_PARSER:
            raise ValueError(f"reasoning_parser {REASONING_PARSER} (--reasoning-parser) is gpt-oss's harmony format, "
                             f"and {model_dir} is not a gpt_oss model (config.json model_type)")
        return None
    if reasoning_parser not in (None, REASONING_PARSER):
        raise ValueError(f"{model_dir} is a gpt_oss model: its reasoning is parsed from the harmony format; set "
                         f"reasoning_parser (--reasoning-parser) to {REASONING_PARSER} or leave it out, not "
                         f"{reasoning_parser!r}")
    encoding = load_encoding(encodings_dir(os.environ.get(ENV_DIR), cache_dir=default_cache_dir()))
    highest = max(encoding.encode("".join(HARMONY_MARKUP), allowed_special="all"))
    if vocab_size <= highest:
        message = (f"{model_dir} is a gpt_oss model with {vocab_size} token ids, too few for the harmony format's "
                   f"(up to {highest}): not a gpt-oss vocabulary")
        if reasoning_parser == REASONING_PARSER:
            raise ValueError(f"reasoning_parser {REASONING_PARSER}: {message}")
        log.warning("%s; chat is rendered with its chat template, not in harmony", message)
        return None
    return encoding


def render_chat(encoding: HarmonyEncoding, body: dict[str, Any], *, auto_tools: bool,
                start_date: str | None = None) -> HarmonyPrompt:
    """The prompt of chat request ``body`` (see module doc). ``auto_tools``: the server parses calls for tool_choice
    ``auto`` (``--enable-auto-tool-choice``); ``start_date``: the conversation's date (None: today).

    Raises:
        HarmonyInputError: a field harmony cannot render, naming it.
    """
    for name in TEMPLATE_FIELDS:
        if body.get(name) is not None:
            raise HarmonyInputError(f"{name} does not apply to this model: gpt-oss prompts are rendered in the harmony "
                                    "format, not by a chat template; leave it out", name)
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise HarmonyInputError(f"reasoning_effort must be low, medium or high, got {str(effort)[:40]!r}",
                                "reasoning_effort")
    tools = _function_tools(body, auto_tools=auto_tools)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HarmonyInputError("messages must be a non-empty list", "messages")
    instructions: list[str] = []
    rest: list[Message] = []
    call_id_to_name: dict[str, str] = {}
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise HarmonyInputError(f"messages[{i}] must be an object with a string role", "messages")
        if msg["role"] in ("system", "developer"):
            instructions.append(_text(i, msg))
        else:
            rest.extend(_message(i, msg, call_id_to_name))
    system = SystemContent.new().with_conversation_start_date(start_date or datetime.date.today().isoformat())
    if effort is not None:
        system = system.with_reasoning_effort(EFFORTS[effort])
    if not tools:  # no functions to call: the commentary channel (where calls go) is not offered
        channels = system.channel_config.valid_channels if system.channel_config is not None else []
        valid = [c for c in channels if c != "commentary"]
        system = system.with_channel_config(ChannelConfig.require_channels(valid))
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions("\n\n".join(instructions))
    if tools:
        developer = developer.with_function_tools(tools)
    conversation = Conversation.from_messages([Message.from_role_and_content(Role.SYSTEM, system),
                                               Message.from_role_and_content(Role.DEVELOPER, developer), *rest])
    ids = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    return HarmonyPrompt(list(ids), calls=bool(tools))


def _function_tools(body: dict[str, Any], *, auto_tools: bool) -> list[ToolDescription]:
    """The tool definitions to render: none without tools or with tool_choice ``none``."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return []
    if not isinstance(tools, list):
        raise HarmonyInputError("tools must be a list", "tools")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return []
    if choice != "auto":
        raise HarmonyInputError('tool_choice must be "auto" or "none" for gpt-oss: "required" and a named function '
                                "constrain the output, and the harmony output's channels may not be constrained",
                                "tool_choice")
    if not auto_tools:
        raise HarmonyInputError('tool_choice "auto" (the default when tools are given) needs the server started with '
                                '--enable-auto-tool-choice (router.enable_auto_tool_choice: true); or send "none"',
                                "tool_choice")
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise HarmonyInputError(f'tools[{k}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise HarmonyInputError(f"tools[{k}].function.parameters must be a JSON schema object", "tools")
        out.append(ToolDescription.new(fn["name"], fn.get("description") or "", parameters=params))
    return out


def _text(i: int, msg: dict[str, Any]) -> str:
    """Message ``i``'s content as text (a string, or text parts joined)."""
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise HarmonyInputError(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _message(i: int, msg: dict[str, Any], call_id_to_name: dict[str, str]) -> list[Message]:
    """The harmony messages of chat message ``i`` (user, assistant or tool); records the assistant's call ids."""
    role = msg["role"]
    if role == "user":
        return [Message.from_role_and_content(Role.USER, _text(i, msg))]
    if role == "assistant":
        out = []
        thinking = msg.get("reasoning_content", msg.get("reasoning"))
        if isinstance(thinking, str) and thinking:
            out.append(Message.from_role_and_content(Role.ASSISTANT, thinking).with_channel("analysis"))
        calls = msg.get("tool_calls") or []
        if not isinstance(calls, list):
            raise HarmonyInputError(f"messages[{i}].tool_calls must be a list", "messages")
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise HarmonyInputError(f"messages[{i}].tool_calls: each call needs function.name", "messages")
            args = fn.get("arguments")
            args = args if isinstance(args, str) else json.dumps(args if args is not None else {})
            if isinstance(call.get("id"), str):
                call_id_to_name[call["id"]] = fn["name"]
            out.append(Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                       .with_recipient(f"functions.{fn['name']}").with_content_type("json"))
        text = _text(i, msg)
        if text or not out:
            out.insert(len(out) - len(calls), Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
        return out
    if role == "tool":
        name = msg.get("name") or call_id_to_name.get(msg.get("tool_call_id") or "")
        if not isinstance(name, str) or not name:
            raise HarmonyInputError(f"messages[{i}]: a tool message needs the tool_call_id of an earlier assistant "
                                    "call (or a name)", "messages")
        return [Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), _text(i, msg))
                .with_channel("commentary")]
    raise HarmonyInputError(f"messages[{i}].role must be system, developer, user, assistant or tool, got "
                            f"{role[:40]!r}", "messages")
