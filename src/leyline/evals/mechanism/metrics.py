"""A server's own Prometheus counter (``--server-counter``): a selector, its sum on /metrics.

The selector is written as a series of the text exposition format, ``name`` or
``name{label="value",...}``; the value read is the sum over every series of that name whose
labels include the selector's (servers add their own, e.g. vLLM's ``engine`` and
``model_name``). Parsed here, by hand: the format is small and no client library is needed.
"""

from __future__ import annotations

import difflib
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class SelectorError(ValueError):
    """A malformed series selector (or exposition line)."""


class CounterError(RuntimeError):
    """The counter cannot be read: /metrics unreachable or malformed, or no series matches."""


@dataclass(frozen=True, slots=True)
class Selector:
    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        return name == self.name and all(labels.get(k) == v for k, v in self.labels)

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        escape = {ord("\\"): "\\\\", ord('"'): '\\"', ord("\n"): "\\n"}
        inner = ",".join(f'{k}="{v.translate(escape)}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


def _series(text: str) -> tuple[str, dict[str, str], int]:
    """The metric name and labels at the start of ``text``, and where they end."""
    match = _NAME.match(text)
    if match is None:
        raise SelectorError(f"no metric name at the start of {text!r}")
    name, i = match.group(), match.end()
    labels: dict[str, str] = {}
    if i == len(text) or text[i] != "{":
        return name, labels, i
    i += 1
    while True:
        i = _skip_blanks(text, i)
        if text.startswith("}", i):
            return name, labels, i + 1
        label = _LABEL.match(text, i)
        if label is None:
            raise SelectorError(f"expected a label name or '}}' at {i} in {text!r}")
        i = _skip_blanks(text, label.end())
        if not text.startswith("=", i):
            raise SelectorError(f"expected '=' after label {label.group()!r} in {text!r}")
        i = _skip_blanks(text, i + 1)
        if not text.startswith('"', i):
            raise SelectorError(f"label {label.group()!r}: value not quoted in {text!r}")
        value, i = _quoted(text, i + 1)
        if label.group() in labels:
            raise SelectorError(f"label {label.group()!r} given twice in {text!r}")
        labels[label.group()] = value
        i = _skip_blanks(text, i)
        if text.startswith(",", i):
            i += 1  # a trailing comma before '}' is allowed, as in the exposition format
        elif not text.startswith("}", i):
            raise SelectorError(f"expected ',' or '}}' at {i} in {text!r}")


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t":
        i += 1
    return i


def _quoted(text: str, i: int) -> tuple[str, int]:
    """The label value from ``i`` (after its opening quote) and the index after its close."""
    out: list[str] = []
    while i < len(text):
        char = text[i]
        if char == '"':
            return "".join(out), i + 1
        if char == "\\":
            escaped = text[i + 1 : i + 2]
            if escaped not in _ESCAPES:
                raise SelectorError(f"unknown escape '\\{escaped}' in {text!r}")
            out.append(_ESCAPES[escaped])
            i += 2
        else:
            out.append(char)
            i += 1
    raise SelectorError(f"unterminated label value in {text!r}")


def parse_selector(text: str) -> Selector:
    """``name`` or ``name{label="value",...}``; SelectorError (a ValueError) otherwise."""
    text = text.strip()
    name, labels, end = _series(text)
    if end != len(text):
        raise SelectorError(f"unexpected {text[end:]!r} after the selector in {text!r}")
    return Selector(name, tuple(labels.items()))


def samples(exposition: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each series line of a text exposition: name, labels, value (comments and blank lines
    skipped; a timestamp after the value and an OpenMetrics exemplar after '#' ignored)."""
    for number, line in enumerate(exposition.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name, labels, end = _series(line)
            fields = line[end:].split("#", 1)[0].split()
            if not 1 <= len(fields) <= 2 or (line[end : end + 1] not in " \t"):
                raise SelectorError(f"expected ' value [timestamp]' in {line!r}")
            yield name, labels, float(fields[0])
        except ValueError as exc:
            raise SelectorError(f"exposition line {number}: {exc}") from None


def counter_sum(exposition: str, selector: Selector) -> float:
    """The sum over the series ``selector`` matches; CounterError where none does, naming
    the metrics that look like it (a typo fails before a run, not after)."""
    found = list(samples(exposition))
    values = [v for n, labels, v in found if selector.matches(n, labels)]
    if values:
        return sum(values)
    names = sorted({n for n, _, _ in found})
    same = [s for n, s, _ in found if n == selector.name]
    if same:
        seen = ", ".join(str(Selector(selector.name, tuple(s.items()))) for s in same[:5])
        hint = f"series of that name: {seen}"
    else:
        prefix = selector.name.split(":", 1)[0] + ":" if ":" in selector.name else None
        near = [n for n in names if prefix and n.startswith(prefix)]
        near = near or difflib.get_close_matches(selector.name, names, n=5)
        hint = "metrics like it: " + (", ".join(near[:20]) or "none")
    raise CounterError(f"no series matches {selector}; {hint}")


def metrics_url(base_url: str) -> str:
    """/metrics at the server's root: the OpenAI base URL without its ``/v1``."""
    return base_url.rstrip("/").removesuffix("/v1") + "/metrics"


@dataclass(frozen=True, slots=True)
class ServerCounter:
    """Reads ``selector``'s sum at ``url`` when called (a ``Callable[[], float]``)."""

    url: str
    selector: Selector
    api_key: str | None = None

    def __call__(self) -> float:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            request = urllib.request.Request(self.url, headers=headers)
            with urllib.request.urlopen(request, timeout=60) as response:
                text = response.read().decode()
            return counter_sum(text, self.selector)
        except (OSError, ValueError, CounterError) as exc:
            raise CounterError(f"GET {self.url}: {exc}") from exc
