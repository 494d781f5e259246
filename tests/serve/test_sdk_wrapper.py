"""The SDK's wrappers as drop-ins, on the real `leyline serve` (SmolLM2, CPU, real HTTP):
streaming with directives, a new conversation on a new session, ``with_options``, and the
Summarize / ClearToolUses policies with the summary written by the same server.

The agent's tool calls are scripted; the model's replies, the summaries, the directives
and the server's cache edits are real.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import openai
import pytest

from leyline.policies import AsyncLeylineOpenAI, EstimateCounter, LeylineOpenAI

from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]


def output(n: int) -> str:
    lines = [f"{i:>3} | total = price * quantity - discount_{n}_{i}" for i in range(12)]
    return f"file_{n}.py\n" + "\n".join(lines)


def turn(n: int, thought: str | None = None) -> list[dict[str, Any]]:
    """The agent's scripted ``read_file`` call of ``file_<n>.py`` (after its reasoning
    ``thought``, if any) and the tool's output."""
    arguments = json.dumps({"path": f"file_{n}.py"})
    function = {"name": "read_file", "arguments": arguments}
    content = f"<think>{thought}</think>Reading file_{n}.py." if thought else None
    return [
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"id": f"call_{n}", "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": f"call_{n}", "content": output(n)},
    ]


def opening(task: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent. Read files, then answer."},
        {"role": "user", "content": task},
        *turn(1),
    ]


def wrapped(server: Server, policy: str | None, **options: Any) -> LeylineOpenAI:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    session = f"sdk-{uuid.uuid4().hex[:8]}"
    return LeylineOpenAI(client, policy, session=session, counter=EstimateCounter(), **options)


def ask(wrapper: LeylineOpenAI, messages: list[Any], **options: Any) -> Any:
    return wrapper.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=4, temperature=0, **options
    )


def asked_twice(wrapper: LeylineOpenAI) -> list[dict[str, Any]]:
    """The opening of the order-total task, then one more tool turn, each asked: the
    history so far."""
    history = opening("Why is the order total wrong?")
    ask(wrapper, history)
    history += turn(2)
    ask(wrapper, history)
    return history


def test_streaming_with_directives_splices_and_streams_the_same_text(server: Server) -> None:
    streamed = wrapped(server, "truncate:keep_last=1")
    plain = wrapped(server, "truncate:keep_last=1")
    history = opening("Why is the order total wrong?")
    for n in range(2, 5):
        reference = ask(plain, history).choices[0].message.content or ""
        with ask(streamed, history, stream=True) as stream:
            chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reference
        history += turn(n)  # the agent's scripted call replaces the reply
    records = streamed.records
    assert [r.streamed for r in records] == [True] * 3
    assert [r.path for r in records[1:]] == ["splice", "splice"], records
    assert all(r.resync is None and "splice" in r.verbs for r in records[1:])
    # The same edits, streamed or not, cost the same (the first call may hit the server's
    # prefix cache, filled by the other wrapper's first call).
    assert [r.prefilled_tokens for r in records[1:]] == [
        r.prefilled_tokens for r in plain.records[1:]
    ]
    assert records[-1].cleared_tool_uses == ("call_2",)
    streamed.close()
    plain.close()


def test_an_unrelated_conversation_starts_a_new_session(server: Server) -> None:
    wrapper = wrapped(server, "truncate:keep_last=1")
    a = asked_twice(wrapper)
    b = opening("Rename the variable total to amount.")
    ask(wrapper, b)
    record = wrapper.records[-1]
    assert record.new_conversation and record.session != wrapper.records[0].session
    assert record.directives == 0 and record.resync is None
    a += turn(3)
    ask(wrapper.with_options(timeout=60.0), a)  # back to A, through a copy
    back = wrapper.records[-1]
    assert back.session == wrapper.records[0].session and back.path == "splice"
    assert back.resync is None and back.verbs
    wrapper.close()


def test_summarize_on_the_real_server(server: Server) -> None:
    policy = 'summarize:trigger={"messages":8},keep_last=1,max_tokens=8'
    wrapper = wrapped(server, policy)
    history = opening("Why is the order total wrong?")
    for n in range(2, 6):
        ask(wrapper, history)
        history += turn(n)
    fired = [r for r in wrapper.records if r.edits]
    assert fired, "the trigger was crossed"
    for record in fired:
        assert record.path == "splice" and record.resync is None and record.plan_fallback is None
        assert record.cleared_tool_uses and record.cleared_tokens > 0
    sent = wrapper.episode.last_plan
    assert sent is not None
    assert str(sent.messages[2]["content"]).startswith("[Summary of the earlier conversation]")
    assert len(sent.messages) < len(history)
    wrapper.close()


def test_async_streaming_with_clear_tool_uses(server: Server) -> None:
    async def main() -> AsyncLeylineOpenAI:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        )
        policy = "clear_tool_uses:trigger=500,keep=1,clear_tool_inputs=true"
        async with AsyncLeylineOpenAI(client, policy, counter=EstimateCounter()) as wrapper:
            history = opening("Why is the order total wrong?")
            for n in range(2, 6):
                stream = await wrapper.chat.completions.create(
                    model="smollm2", messages=history, max_tokens=4, temperature=0, stream=True
                )
                async for _ in stream:
                    pass
                history += turn(n)
        return wrapper

    wrapper = asyncio.run(main())
    fired = [r for r in wrapper.records if r.cleared_tool_uses]
    assert fired and all(r.path == "splice" and r.resync is None for r in fired), wrapper.records
    assert all(r.streamed for r in wrapper.records)
