"""Token counting for budgets: the server's tokenizer, tiktoken, or a documented estimate.

tiktoken downloads its encoding files on first use; offline (or behind a proxy that only
serves package registries) that fails, and a silent hang would stall an agent. So loading
is bounded by a timeout, and when no exact counter is available the estimate
``ceil(chars / 4)`` is used (OpenAI's rule of thumb for English), with one warning.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .messages import Message, canonical_json, content_text

MESSAGE_OVERHEAD = 4
"""Tokens a chat template adds around one message (role header, end marker), roughly."""


@runtime_checkable
class TokenCounter(Protocol):
    """Anything that counts the tokens of a text."""

    @property
    def name(self) -> str: ...

    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class EstimateCounter:
    """``ceil(len(text) / chars_per_token)``: an estimate, not a tokenizer."""

    chars_per_token: float = 4.0

    @property
    def name(self) -> str:
        return f"estimate(chars/{self.chars_per_token:g})"

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)


class CallableCounter:
    """Counts with a tokenize function, e.g. the server's: exact for that server's model.

    ``CallableCounter(lambda s: client.tokenize(s).tokens)`` with a
    :class:`leyline.protocol.client.LeylineClient`. Results are cached per text, since a
    budget recounts the same messages every turn.
    """

    def __init__(self, tokenize: Callable[[str], Sequence[int]], name: str = "tokenizer") -> None:
        self._name = name
        self._count = functools.lru_cache(maxsize=4096)(lambda text: len(tokenize(text)))

    @property
    def name(self) -> str:
        return self._name

    def count(self, text: str) -> int:
        return int(self._count(text))


class TiktokenCounter:
    """Counts with a tiktoken encoding (exact for OpenAI models, close for others)."""

    def __init__(self, encoding: object, name: str) -> None:
        self._encoding = encoding
        self._name = f"tiktoken:{name}"

    @property
    def name(self) -> str:
        return self._name

    def count(self, text: str) -> int:
        encode = self._encoding.encode  # type: ignore[attr-defined]
        return len(encode(text, disallowed_special=()))

    @classmethod
    def load(cls, encoding: str = "o200k_base", timeout: float = 5.0) -> TiktokenCounter | None:
        """The encoding, or None if it cannot be had within ``timeout`` seconds.

        Runs in a daemon thread: tiktoken's download has no timeout of its own.
        """
        result: list[object] = []

        def fetch() -> None:
            try:
                import tiktoken

                result.append(tiktoken.get_encoding(encoding))
            except Exception as exc:  # any failure means "not available here"
                result.append(exc)

        worker = threading.Thread(target=fetch, name="leyline-tiktoken", daemon=True)
        worker.start()
        worker.join(timeout)
        if not result or isinstance(result[0], BaseException):
            return None
        return cls(result[0], encoding)


@functools.cache
def default_counter() -> TokenCounter:
    """tiktoken's ``o200k_base`` when it loads, else :class:`EstimateCounter` (warned once)."""
    counter = TiktokenCounter.load()
    if counter is not None:
        return counter
    warnings.warn(
        "tiktoken's encoding is not available (no network?); token budgets and counts use the "
        "estimate ceil(chars / 4). Pass counter=CallableCounter(server tokenize) for exact "
        "counts.",
        RuntimeWarning,
        stacklevel=2,
    )
    return EstimateCounter()


def message_tokens(counter: TokenCounter, message: Message) -> int:
    """Tokens of one message: content, tool calls, and the template's overhead."""
    text = content_text(message)
    if text is None:
        text = canonical_json(message.get("content"))
    total = counter.count(text) + MESSAGE_OVERHEAD
    calls = message.get("tool_calls")
    if calls:
        total += counter.count(canonical_json(calls))
    return total
