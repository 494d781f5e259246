"""Token counters: pluggable, exact when a tokenizer is at hand, never crashing offline."""

from __future__ import annotations

import time
import warnings

import pytest

from leyline.policies import (
    CallableCounter,
    EstimateCounter,
    TiktokenCounter,
    TokenCounter,
    counting,
    message_tokens,
)

from .transcripts import assistant, call


def test_estimate_is_ceil_chars_over_four() -> None:
    counter = EstimateCounter()
    assert isinstance(counter, TokenCounter)
    assert [counter.count(t) for t in ("", "abc", "abcd", "abcde")] == [0, 1, 1, 2]
    assert EstimateCounter(chars_per_token=2).count("abcde") == 3


def test_callable_counter_uses_the_given_tokenizer_and_caches() -> None:
    seen: list[str] = []

    def tokenize(text: str) -> list[int]:
        seen.append(text)
        return [ord(c) for c in text]

    counter = CallableCounter(tokenize, name="server")
    assert counter.count("hello") == 5 and counter.count("hello") == 5
    assert seen == ["hello"] and counter.name == "server"


def test_message_tokens_count_content_tool_calls_and_overhead() -> None:
    counter = EstimateCounter(chars_per_token=1)
    plain = {"role": "user", "content": "abcd"}
    assert message_tokens(counter, plain) == 4 + counting.MESSAGE_OVERHEAD
    with_call = assistant(call("x", "view", path="a"))
    assert message_tokens(counter, with_call) > counting.MESSAGE_OVERHEAD + 20


def test_tiktoken_load_gives_none_when_the_encoding_cannot_be_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tiktoken

    def offline(name: str) -> object:
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    assert TiktokenCounter.load("cl100k_base") is None


def test_tiktoken_load_is_bounded_by_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: time.sleep(5))
    started = time.monotonic()
    assert TiktokenCounter.load(timeout=0.2) is None
    assert time.monotonic() - started < 2


def test_default_counter_falls_back_to_the_estimate_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(TiktokenCounter, "load", classmethod(lambda cls, *a, **k: None))
    counting.default_counter.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            counter = counting.default_counter()
        assert isinstance(counter, EstimateCounter)
        assert any("ceil(chars / 4)" in str(w.message) for w in caught)
    finally:
        counting.default_counter.cache_clear()


def test_tiktoken_counter_counts_with_its_encoding() -> None:
    class Encoding:
        def encode(self, text: str, disallowed_special: object = ()) -> list[int]:
            return list(range(len(text.split())))

    counter = TiktokenCounter(Encoding(), "fake")
    assert counter.count("a b c") == 3 and counter.name == "tiktoken:fake"
