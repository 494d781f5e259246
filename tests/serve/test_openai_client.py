"""The official openai client, unchanged, against `leyline serve` (real HTTP, real model)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_plain_and_streaming_chat_agree(server: Server) -> None:
    openai = client(server)
    plain = openai.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"leyline": {"session": "openai-1"}},
    )
    text = plain.choices[0].message.content or ""
    assert "Paris" in text
    leyline = (plain.model_extra or {})["leyline"]
    assert leyline["session"] == "openai-1" and leyline["revision"] >= 1
    assert leyline["reused_tokens"] + leyline["prefilled_tokens"] == plain.usage.prompt_tokens  # type: ignore[union-attr]

    stream = openai.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=8,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
        extra_body={"leyline": {"session": "openai-1"}},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    final = chunks[-1]
    assert (final.model_extra or {})["leyline"]["path"] in {"prefix_hit", "reprefill"}
    assert final.usage is not None and final.usage.completion_tokens >= 1


def test_streamed_chat_carries_the_same_logprobs(server: Server) -> None:
    openai = client(server)
    request = dict(
        model="smollm2",
        messages=QUESTION,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    plain = openai.chat.completions.create(**request)  # type: ignore[call-overload]
    chunks = list(openai.chat.completions.create(stream=True, **request))  # type: ignore[call-overload]
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    expected = plain.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in expected] and len(expected) == 4
    for got, want in zip(streamed, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]


def test_models_and_text_completions(server: Server) -> None:
    openai = client(server)
    assert [m.id for m in openai.models.list()] == ["SmolLM2-135M-Instruct"]
    done = openai.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    choice = done.choices[0]
    assert "Paris" in choice.text
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 3
