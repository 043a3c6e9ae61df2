"""`Tokenizer`: a Hugging Face ``tokenizer.json`` plus the chat template of ``tokenizer_config.json``.

Encoding follows ``transformers.AutoTokenizer`` (5.x) exactly: ``tokenizer.json`` decides, its own
post-processor adds whatever BOS / EOS it adds (``add_bos_token`` in ``tokenizer_config.json`` does
not override it), and the special tokens that ``tokenizer_config.json`` names (``bos_token``,
``eos_token``, ``unk_token``, ``pad_token``) are registered as special tokens if ``tokenizer.json``
did not already make them so: they are never split and ``skip_special_tokens`` drops them.

Chat templates are rendered the way transformers renders them: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, a ``raise_exception`` helper, a ``tojson`` that does not
escape HTML, and the special tokens as variables. A rendered chat prompt already holds whatever BOS
the template writes, so it is encoded with ``add_special_tokens=False``, as
``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode, decode and render chats for one model.

    Attributes:
        eos_token_ids: ids that end generation (the tokenizer's EOS plus ``config.json``'s).
        chat_template: the Jinja source, or None when the model has none.
        byte_level: the decoder is GPT-2's ByteLevel (`token_bytes` says what each id decodes to).
        special_ids: the ids that ``skip_special_tokens`` drops.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str],
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self._tokenizer = tokenizer
        self._special_tokens = dict(special_tokens)
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.byte_level = isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel)
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._char_to_byte = {c: b for b, c in byte_level_alphabet().items()}
        self._id_to_bytes: dict[int, bytes] = {}  # token_bytes' memo; only token_bytes writes it

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, as ``AutoTokenizer(text).input_ids`` gives them.

        With ``add_special_tokens`` the post-processor of ``tokenizer.json`` runs (it adds BOS where
        the model's tokenizer does); without, it does not (chat prompts, see module doc). Special-token
        text inside ``text`` (e.g. ``"<|im_start|>"``) maps to its special id, as in transformers.
        """
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a `byte_level` tokenizer's decoder makes of ``token_id``.

        ``decode(ids)`` of a `byte_level` tokenizer is these bytes of each id joined (without
        `special_ids` when they are skipped) as UTF-8, each ill-formed part as U+FFFD: ByteLevel maps
        a token's characters back through GPT-2's byte alphabet, or, when a character is outside it
        (an added token such as ``"日x"``), takes the token's own UTF-8; an id the tokenizer does not
        know decodes to nothing (``b""``).

        Raises:
            ValueError: the tokenizer is not `byte_level` (its decoder does not work on bytes).
        """
        data = self._id_to_bytes.get(token_id)
        if data is None:
            if not self.byte_level:
                raise ValueError("token_bytes needs a ByteLevel decoder; this tokenizer's is "
                                 f"{type(self._tokenizer.decoder).__name__}")
            token = self._tokenizer.id_to_token(token_id)
            if token is None:
                data = b""
            elif all(c in self._char_to_byte for c in token):
                data = bytes(self._char_to_byte[c] for c in token)
            else:
                data = token.encode()
            self._id_to_bytes[token_id] = data
        return data

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        ``tools``: the functions the model may call, in OpenAI's shape (``[{"type": "function", "function":
        {"name", "description", "parameters"}}]``), as transformers passes them (templates that take none
        ignore them). Messages may carry what tool-use templates read: an assistant's ``tool_calls``
        (``[{"type": "function", "function": {"name", "arguments": {...}}}]``, arguments an object) and a tool
        result's ``tool_call_id``. ``template_kwargs``: more names for the template (vLLM's
        ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``; ``documents``); they cannot replace
        ``messages``, ``tools``, ``add_generation_prompt`` or the special tokens.

        Raises:
            ValueError: the model has no chat template.
            jinja2.TemplateError: the template rejected the messages (its ``raise_exception`` text).
        """
        if self.chat_template is None:
            raise ValueError("this model's tokenizer_config.json has no chat_template; send a plain prompt")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        names = {"documents": None, **(template_kwargs or {}), **self._special_tokens}
        return self._compiled_template.render(
            **{**names, "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools},
        )


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (the alphabet of ByteLevel tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandboxed environment configured as transformers configures it."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of ``model_dir``, or None when it has no ``tokenizer.json``.

    Raises:
        ValueError: ``tokenizer.json`` or ``tokenizer_config.json`` cannot be parsed.
    """
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{path} cannot be loaded: {exc}") from None
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    model_config = _read_json(model_dir / "config.json")
    special_tokens = _special_tokens(tok_config, _read_json(model_dir / "special_tokens_map.json"))
    # As transformers' TokenizersBackend._post_init: named special tokens become special added tokens.
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    tok.add_special_tokens([tokenizers.AddedToken(text, special=True, normalized=False)
                            for text in special_tokens.values() if text not in added])
    eos_ids: list[int] = []
    if "eos_token" in special_tokens:
        eos = tok.token_to_id(special_tokens["eos_token"])
    elif "eos_token" in tok_config:  # present but null: the model has none
        eos = None
    else:
        eos = model_config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
    config_eos = model_config.get("eos_token_id")
    for value in [eos, *(config_eos if isinstance(config_eos, list) else [config_eos])]:
        if value is not None and value not in eos_ids:
            eos_ids.append(int(value))
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return Tokenizer(tok, special_tokens=special_tokens, eos_token_ids=tuple(eos_ids), chat_template=template)


def _special_tokens(tok_config: dict[str, Any], special_map: dict[str, Any]) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}`` from tokenizer_config.json, falling back to special_tokens_map.json."""
    out: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tok_config[name] if name in tok_config else special_map.get(name)
        if isinstance(value, dict):  # AddedToken serialisation: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def resolve_chat_template(value: str) -> str:
    """The Jinja source ``value`` names, as vLLM's ``--chat-template`` takes it: the path of a file, else the template
    itself (it has ``{{`` or ``{%``); compiled here, so a broken one is refused at start, not at the first chat.

    Raises:
        ValueError: neither a readable file nor a template, or a template that does not compile (naming why).
    """
    path = Path(value)
    if path.is_file():
        try:
            source = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat template {value}: cannot read it ({exc})") from None
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    try:
        compile_chat_template(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template {value if path.is_file() else '(inline)'} does not compile: {exc}") from None
    return source
