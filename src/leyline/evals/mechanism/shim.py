"""A client shim that streams underneath the (non-streaming) Leyline middleware.

``LeylineOpenAI`` wants a ``ChatCompletion``; the benchmark wants the time to the first
streamed chunk. ``TimedClient`` looks like ``openai.OpenAI``, sends each chat request with
``stream=True``, notes the TTFT and the first generated token (from the final chunk's
logprobs), and reassembles the stream into the completion the server would have sent.
The server opens a stream only after the first token, so the TTFT is queue wait + edit +
prefill + one token, as the client sees it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import openai
from openai.types.chat import ChatCompletion


@dataclass
class Clock:
    """What the last chat request of one client arm measured."""

    last_ttft_s: float = 0.0
    last_first_token: str | None = None
    last_timing: dict[str, float] | None = None
    """The server's ``leyline.timing`` (queued, service, decode seconds), if it sends one."""


class _StreamedCompletions:
    def __init__(self, inner: openai.OpenAI, clock: Clock) -> None:
        self._inner, self._clock = inner, clock

    def create(self, **kwargs: Any) -> ChatCompletion:
        kwargs.pop("stream", None)
        t0 = time.perf_counter()
        stream = self._inner.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
        first: float | None = None
        first_token: str | None = None
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        finish, usage, leyline, meta = "stop", None, None, {}
        for chunk in stream:
            first = time.perf_counter() - t0 if first is None else first
            meta = {"id": chunk.id, "created": chunk.created, "model": chunk.model}
            leyline = (chunk.model_extra or {}).get("leyline", leyline)
            usage = chunk.usage.model_dump() if chunk.usage else usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                content.append(choice.delta.content or "")
                calls += [c.model_dump(exclude_none=True) for c in choice.delta.tool_calls or []]
                if first_token is None and choice.logprobs and choice.logprobs.content:
                    first_token = choice.logprobs.content[0].token
        self._clock.last_ttft_s = first if first is not None else time.perf_counter() - t0
        self._clock.last_first_token = first_token
        self._clock.last_timing = leyline.get("timing") if isinstance(leyline, dict) else None
        return _assemble(meta, "".join(content), calls, finish, usage, leyline)


def _assemble(
    meta: dict[str, Any],
    text: str,
    calls: list[dict[str, Any]],
    finish: str,
    usage: object,
    leyline: object,
) -> ChatCompletion:
    """The non-streamed response the server would have sent (same content rule)."""
    for call in calls:
        call.pop("index", None)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    body = {
        **meta,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
        "leyline": leyline,
    }
    return ChatCompletion.model_validate(body)


class TimedClient:
    """Looks like ``openai.OpenAI`` to ``LeylineOpenAI``; chat requests stream underneath."""

    def __init__(self, inner: openai.OpenAI, clock: Clock) -> None:
        self.inner, self.clock = inner, clock
        self.chat = SimpleNamespace(completions=_StreamedCompletions(inner, clock))

    def with_options(self, **kwargs: Any) -> TimedClient:
        return TimedClient(self.inner.with_options(**kwargs), self.clock)

    def __getattr__(self, name: str) -> Any:  # base_url, get, post, delete: the real client
        return getattr(self.inner, name)
