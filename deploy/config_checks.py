"""The validators of YAML config values: each a `Check` that converts one value and says what it accepts.

A check's ``parse(value)`` returns what the config holds (sizes as bytes, lists as tuples) or raises
ValueError whose message completes ``"<key path>: <value!r> "`` (`deploy.service_config.Section.take` adds
the prefix), e.g. ``router.max_n: 0 is not a positive integer``. ``type`` and ``allowed`` are the reference's
columns (`deploy.config_reference`), so what the page says is what the parser checks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.deploy.sizes import parse_size
from kvrelay.kvstore.admission import parse_admission
from kvrelay.kvstore.digest import INTEGRITY_MODES
from kvrelay.kvstore.policy import POLICY_NAMES, parse_policy
from kvrelay.model.device import check_device_name
from kvrelay.transfer.discovery import parse_dns_name


@dataclass(frozen=True, slots=True)
class Check:
    """One value's validator. ``type``: the YAML type; ``allowed``: the accepted values, in words.

    Raises (``parse``):
        ValueError: the value is outside ``allowed``; the message reads after ``"<key>: <value!r> "``.
        TypeError: likewise (reported the same way).
    """

    parse: Callable[[Any], Any]
    type: str
    allowed: str

    def __call__(self, value: Any) -> Any:
        return self.parse(value)


def check(type_: str, allowed: str) -> Callable[[Callable[[Any], Any]], Check]:
    """Decorator: the function becomes a `Check` with this ``type`` and ``allowed`` text."""
    def wrap(parse: Callable[[Any], Any]) -> Check:
        return Check(parse, type_, allowed)

    return wrap


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# -------------------------------------------------------------------- scalars
@check("integer", "> 0")
def positive_int(v: Any) -> int:
    if not _is_int(v) or v <= 0:
        raise ValueError("is not a positive integer")
    return v


@check("integer", ">= 0")
def non_negative_int(v: Any) -> int:
    if not _is_int(v) or v < 0:
        raise ValueError("is not an integer >= 0")
    return v


@check("number", "> 0")
def positive_float(v: Any) -> float:
    if not _is_number(v) or v <= 0:
        raise ValueError("is not a positive number")
    return float(v)


@check("number", ">= 0, finite")
def non_negative_float(v: Any) -> float:
    if not _is_number(v) or not 0 <= v < float("inf"):
        raise ValueError("is not a number >= 0")
    return float(v)


@check("number", ">= 0, finite")
def finite_non_negative_float(v: Any) -> float:
    if not _is_number(v) or not 0 <= v < float("inf"):
        raise ValueError("is not a finite number >= 0")
    return float(v)


@check("number", "(0, 1]")
def fraction(v: Any) -> float:
    if not _is_number(v) or not 0 < v <= 1:
        raise ValueError("is not a fraction in (0, 1]")
    return float(v)


@check("number", "(0, 1]")
def unit_fraction(v: Any) -> float:
    if not _is_number(v) or not 0 < v <= 1:
        raise ValueError("is not a number in (0, 1]")
    return float(v)


@check("boolean", "true, false")
def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("is not true or false")
    return v


@check("string", "non-empty")
def string(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("is not a non-empty string")
    return v


@check("string", "a Jinja file's path, or a Jinja template")
def chat_template(v: Any) -> str:
    """Kept as given; refused unless it names a readable file or is a template, and compiles."""
    from kvrelay.model.tokenizer import resolve_chat_template

    if not isinstance(v, str) or not v:
        raise ValueError("is not a non-empty string")
    resolve_chat_template(v)
    return v


@check("size", '> 0; bytes, or a binary unit: "512MiB", "8GiB", "1.5TiB"')
def size(v: Any) -> int:
    return parse_size(v)


@check("string", "auto, cpu, cuda, cuda:N")
def device_name(v: Any) -> str:
    return check_device_name(v)


@check("integer", "0 – 65535")
def port(v: Any) -> int:
    if not _is_int(v) or not 0 <= v < 65536:
        raise ValueError("is not a TCP port")
    return v


@check("string", "an http:// or https:// URL")
def http_url(v: Any) -> str:
    if not isinstance(v, str) or not v.startswith(("http://", "https://")):
        raise ValueError("is not an http:// or https:// URL")
    return v


def one_of(options: tuple[str, ...], *, message: str | None = None) -> Check:
    """A check that ``v`` is one of ``options``; ``message`` replaces ``is not one of [...]``."""
    def parse(v: Any) -> str:
        if v not in options:
            raise ValueError(message or f"is not one of {list(options)}")
        return v

    return Check(parse, "string", ", ".join(options))


# -------------------------------------------------------------------- kvstore
@check("string", ", ".join(INTEGRITY_MODES))
def integrity(v: Any) -> str:
    if v is False:  # YAML 1.1 reads a bare ``off`` as false
        return "off"
    if v not in INTEGRITY_MODES:
        raise ValueError(f"is not one of {list(INTEGRITY_MODES)}")
    return str(v)


@check("string", '"all", or "seen>=N" with N >= 1')
def admission(v: Any) -> str:
    try:
        parse_admission(v)
    except ValueError:
        raise ValueError('is not an admission policy; use "all" or "seen>=N" with N >= 1, e.g. "seen>=2"') from None
    return v.strip()


@check("string", ", ".join(POLICY_NAMES))
def tier_policy(v: Any) -> str:
    try:
        return parse_policy(v)
    except ValueError:
        raise ValueError(f"is not a tier policy; use one of {', '.join(POLICY_NAMES)}") from None


# ---------------------------------------------------------------------- lists
@check("list of integers", "each 0 – 65535")
def port_list(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(p) and 0 <= p < 65536 for p in v):
        raise ValueError("is not a list of TCP ports")
    return tuple(v)


@check("list of integers", "non-empty, each > 0")
def batch_sizes(v: Any) -> tuple[int, ...]:
    """Sorted, without repeats."""
    if not isinstance(v, list) or not v or not all(_is_int(s) and s > 0 for s in v):
        raise ValueError("is not a non-empty list of positive integers")
    return tuple(sorted(set(v)))


@check("list of strings", "each non-empty")
def string_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ValueError("is not a list of non-empty strings")
    return tuple(v)


@check("list of strings", "each an http:// or https:// URL")
def url_list(v: Any) -> tuple[str, ...]:
    """Without trailing slashes."""
    if not isinstance(v, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in v):
        raise ValueError("is not a list of http:// URLs")
    return tuple(u.rstrip("/") for u in v)


@check("list of strings", "each host:port")
def dns_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise ValueError("is not a list of host:port names")
    for name in v:
        parse_dns_name(name)
    return tuple(v)


@check("list", 'each a CUDA device index, or several as "0,1"')
def device_list(v: Any) -> tuple[str, ...]:
    """Indices as strings (``CUDA_VISIBLE_DEVICES`` values); how many there must be is the caller's check."""
    if not isinstance(v, list) or not all(_is_int(d) and d >= 0 or isinstance(d, str) and re.fullmatch(r"\d+(,\d+)*", d)
                                          for d in v):
        raise ValueError('is not a list of CUDA device indices (one per node; e.g. [0, 1] or ["0,1", "2,3"])')
    return tuple(str(d) for d in v)


def subset_list(options: tuple[str, ...]) -> Check:
    """A check that ``v`` is a list whose items are all in ``options``."""
    def parse(v: Any) -> tuple[str, ...]:
        if not isinstance(v, list) or any(f not in options for f in v):
            raise ValueError(f"is not a list of {list(options)}")
        return tuple(v)

    return Check(parse, "list of strings", "each one of " + ", ".join(options))


# ---------------------------------------------------------------- key order
@dataclass(frozen=True, slots=True)
class KeyOrder:
    """Two keys whose values must be ordered: ``smaller`` < ``larger`` (``strict``) or <=, for ``why``."""

    smaller: str
    larger: str
    strict: bool
    why: str


# Timeouts one component waits out while another waits on it: out of order, the outer one fires first and
# the inner one's cleaner ending never happens.
KEY_ORDERS = (
    KeyOrder("router.write_stall_timeout_s", "decode.write_stall_timeout_s", True,
             "a decode node must not cut off a router that is only waiting for its own slow client (the router "
             "drops that client first and ends the request itself)"),
)


def check_key_order(value_of: Callable[[str], float], orders: tuple[KeyOrder, ...] = KEY_ORDERS) -> None:
    """Check each pair of ``orders`` on ``value_of(key path)``.

    Raises:
        ValueError: the first pair out of order, naming both keys, their values and why, e.g.
            ``decode.write_stall_timeout_s (5) must be > router.write_stall_timeout_s (600): ...``.
    """
    for o in orders:
        small, large = value_of(o.smaller), value_of(o.larger)
        if small < large or (small == large and not o.strict):
            continue
        raise ValueError(f"{o.larger} ({large:g}) must be {'>' if o.strict else '>='} {o.smaller} ({small:g}): "
                         f"{o.why}; raise {o.larger} or lower {o.smaller}")


def termination_grace_error(*, drain_timeout_s: float, persist_timeout_s: float, grace_period_s: float,
                            margin_s: float) -> str | None:
    """Why a Kubernetes ``terminationGracePeriodSeconds`` of ``grace_period_s`` is too short for a node that
    drains for ``internal.drain_timeout_s``, then persists its KV for ``internal.persist_timeout_s``, then exits
    within ``margin_s`` (`kvrelay up` allows the same, `deploy.up.GRACE_S`); None when it is long enough."""
    need = drain_timeout_s + persist_timeout_s + margin_s
    if grace_period_s >= need:
        return None
    return (f"terminationGracePeriodSeconds ({grace_period_s:g}) must be >= internal.drain_timeout_s "
            f"({drain_timeout_s:g}) + internal.persist_timeout_s ({persist_timeout_s:g}) + {margin_s:g}: the pod "
            "is killed before its KV reaches disk")
