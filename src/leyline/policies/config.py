"""The config-string syntax: ``truncate:keep_last=2``, ``stale | truncate:keep_last=2``.

Grammar (``|`` chains policies; brackets, braces, parentheses and quotes nest)::

    pipeline := policy ("|" policy)*
    policy   := NAME [":" option ("," option)*]
    option   := KEY "=" VALUE
    VALUE    := JSON | "(" pipeline ")" | bare text

A value that is not JSON is passed on as text; pydantic converts it to the field's type, so
``keep_last=2`` and ``keep_last="2"`` are the same, and ``stub=[gone: {tool}]`` is a
string. Lists and dicts are JSON: ``exclude_tools=["plan"]``. A parenthesised pipeline is a nested
policy (for ``when``). This module only parses; :mod:`.registry` builds the policies.
"""

from __future__ import annotations

import json
import re

from .errors import PolicyConfigError

NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_OPEN = {"(": ")", "[": "]", "{": "}"}


def split_top(text: str, separator: str, config: str) -> list[str]:
    """Split at ``separator`` where it is outside brackets and quotes."""
    parts: list[str] = []
    stack: list[str] = []
    quote: str | None = None
    start = 0
    escaped = False
    for k, char in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char in _OPEN:
            stack.append(_OPEN[char])
        elif char in _OPEN.values():
            if not stack or stack.pop() != char:
                raise PolicyConfigError(config, f"unbalanced {char!r} in {text!r}")
        elif char == separator and not stack:
            parts.append(text[start:k])
            start = k + 1
    if quote:
        raise PolicyConfigError(config, f"unterminated quote {quote} in {text!r}")
    if stack:
        raise PolicyConfigError(config, f"missing {stack[-1]!r} in {text!r}")
    parts.append(text[start:])
    return parts


def parse_value(raw: str, config: str) -> object:
    value = raw.strip()
    if value.startswith("(") and value.endswith(")"):
        return value[1:-1].strip()  # a nested pipeline, built by the field that takes it
    try:
        return json.loads(value)
    except ValueError:
        pass
    return value


def parse_policy_spec(text: str, config: str) -> tuple[str, dict[str, object]]:
    """``name:key=value,...`` -> ``(name, {key: value})``."""
    name, colon, options = text.partition(":")
    name = name.strip()
    if not name:
        raise PolicyConfigError(config, f"missing policy name in {text.strip()!r}")
    if not NAME.fullmatch(name):
        raise PolicyConfigError(config, f"{name!r} is not a policy name")
    params: dict[str, object] = {}
    if colon and not options.strip():
        raise PolicyConfigError(config, f"{name}: nothing after ':' (drop it or add key=value)")
    for option in split_top(options, ",", config) if options.strip() else []:
        key, equals, raw = option.partition("=")
        key = key.strip()
        if not equals or not NAME.fullmatch(key):
            raise PolicyConfigError(
                config, f"{name}: option {option.strip()!r} is not of the form key=value"
            )
        if key == "type":
            raise PolicyConfigError(config, f"{name}: 'type' is given by the name before ':'")
        if key in params:
            raise PolicyConfigError(config, f"{name}: option {key!r} is given twice")
        params[key] = parse_value(raw, config)
    return name, params


def parse_pipeline(text: str) -> list[tuple[str, dict[str, object]]]:
    """Parse a config string into ``(name, options)`` per policy, in chain order.

    Raises:
        PolicyConfigError: naming the problem (empty stage, bad option, unbalanced bracket).
    """
    if not text.strip():
        raise PolicyConfigError(text, "empty config; expected e.g. 'truncate:keep_last=2'")
    stages = split_top(text, "|", text)
    if any(not stage.strip() for stage in stages):
        raise PolicyConfigError(text, "empty policy between '|' separators")
    return [parse_policy_spec(stage, text) for stage in stages]
