"""The OpenAI-client wrappers against a server without Leyline (real HTTP, loopback).

The server is a stand-in for "any other OpenAI server" (``plain_server``). No torch: these
run in the SDK's torch-free venv too. The Leyline path is tested against the real
`leyline serve` in ``tests/integration``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import openai
import pytest

from leyline.policies import AsyncLeylineOpenAI, LeylineOpenAI
from leyline.policies.middleware_core import same_reply
from leyline.policies.middleware_wire import server_root, support_from_capabilities

from .plain_server import PlainServer, plain_server
from .transcripts import assistant, call, system, tool, user, view_output

POLICY = "truncate:keep_last=1"
STUB = "[evicted:"


def turn(n: int) -> list[dict[str, Any]]:
    """The agent's scripted tool call of turn ``n`` and its output."""
    return [
        assistant(call(f"c{n}", "view", path=f"f{n}.py")),
        tool(f"c{n}", view_output(f"f{n}.py", n)),
    ]


def opening() -> list[dict[str, Any]]:
    return [system(), user("Fix the failing test."), *turn(1)]


def sync_client(server: PlainServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)


def run_turns(wrapper: LeylineOpenAI, turns: int) -> list[Any]:
    history: list[Any] = opening()
    for n in range(2, turns + 2):
        completion = wrapper.chat.completions.create(model="plain", messages=history)
        history += [completion.choices[0].message, *turn(n)]  # the reply as an OpenAI object
    return history


def test_plain_server_gets_the_edited_messages_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="leyline.policies.middleware")
    with plain_server() as server:
        wrapper = LeylineOpenAI(sync_client(server), POLICY)
        run_turns(wrapper, 4)
        wrapper.close()
    assert len(caplog.records) == 1
    assert "not found" in caplog.records[0].getMessage()
    assert server.paths.count("GET /leyline/v1/capabilities") == 1
    assert all("leyline" not in body for body in server.requests)
    last = server.requests[-1]["messages"]
    tool_texts = [m["content"] for m in last if m["role"] == "tool"]
    assert [t.startswith(STUB) for t in tool_texts] == [True, True, True, False]
    assert [r.leyline for r in wrapper.records] == [False] * 4
    assert [r.path for r in wrapper.records] == [None] * 4
    assert [r.directives for r in wrapper.records] == [0] * 4
    assert [r.edits for r in wrapper.records] == [0, 1, 1, 1]


def test_async_wrapper_on_a_plain_server() -> None:
    async def episode(server: PlainServer) -> AsyncLeylineOpenAI:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        async with AsyncLeylineOpenAI(client, POLICY) as wrapper:
            history: list[Any] = opening()
            for n in range(2, 5):
                done = await wrapper.chat.completions.create(model="plain", messages=history)
                history += [done.choices[0].message, *turn(n)]
        return wrapper

    with plain_server() as server:
        wrapper = asyncio.run(episode(server))
    assert [r.edits for r in wrapper.records] == [0, 1, 1]
    assert all("leyline" not in body for body in server.requests)
    stubbed = [m for m in server.requests[-1]["messages"] if m["role"] == "tool"]
    assert [m["content"].startswith(STUB) for m in stubbed] == [True, True, False]


def test_a_failed_call_leaves_the_episode_as_it_was() -> None:
    with plain_server() as control_server, plain_server() as server:
        control = LeylineOpenAI(sync_client(control_server), POLICY)
        wrapper = LeylineOpenAI(sync_client(server), POLICY)
        history: list[Any] = opening()
        for n in range(2, 5):
            if n == 3:
                server.fail_next = [500]
                with pytest.raises(openai.InternalServerError):
                    wrapper.chat.completions.create(model="plain", messages=history)
                assert len(wrapper.records) == 1  # nothing recorded, nothing committed
            control.chat.completions.create(model="plain", messages=history)
            wrapper.chat.completions.create(model="plain", messages=history)
            history += [{"role": "assistant", "content": "ok"}, *turn(n)]
        failed = server.requests.pop(1)
        assert failed == server.requests[1]  # the retry sent exactly what had failed
        assert server.requests == control_server.requests
        assert [r.edits for r in wrapper.records] == [r.edits for r in control.records]


def test_diff_mode_sends_the_agents_own_rewrite() -> None:
    with plain_server() as server:
        wrapper = LeylineOpenAI(sync_client(server))  # no policy: the agent edits itself
        history = opening()
        wrapper.chat.completions.create(model="plain", messages=history)
        history[3] = {**history[3], "content": "[dropped by the agent]"}
        history += turn(2)
        wrapper.chat.completions.create(model="plain", messages=history)
    assert server.requests[-1]["messages"][3]["content"] == "[dropped by the agent]"
    assert [r.edits for r in wrapper.records] == [0, 0]


def test_options_pass_through_and_misuse_is_refused() -> None:
    with plain_server() as server:
        wrapper = LeylineOpenAI(sync_client(server), POLICY)
        wrapper.chat.completions.create(
            model="plain", messages=opening(), max_tokens=3, extra_body={"top_k": 5}
        )
        assert server.requests[-1]["top_k"] == 5 and server.requests[-1]["max_tokens"] == 3
        with pytest.raises(ValueError, match="leyline"):
            wrapper.chat.completions.create(
                model="plain", messages=opening(), extra_body={"leyline": {}}
            )
        with pytest.raises(TypeError, match="message 0"):
            wrapper.chat.completions.create(model="plain", messages=["hello"])
    assert len(server.requests) == 1


def test_a_server_that_is_down_is_asked_again_next_call() -> None:
    with plain_server() as server:
        url = server.base_url
    wrapper = LeylineOpenAI(openai.OpenAI(base_url=url, api_key="test", max_retries=0), POLICY)
    with pytest.raises(openai.APIConnectionError):
        wrapper.chat.completions.create(model="plain", messages=opening())
    assert wrapper.records == []


def test_support_and_reply_helpers() -> None:
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h:8000") == "http://h:8000"
    ok = support_from_capabilities({"protocol_version": "1.0", "verbs": ["splice"]})
    assert ok.leyline
    newer = support_from_capabilities({"protocol_version": "2.0", "verbs": ["splice"]})
    assert not newer.leyline and "incompatible" in newer.note
    assert not support_from_capabilities({"protocol_version": "1.0", "verbs": ["erratum"]}).leyline
    assert not support_from_capabilities("<html>").leyline
    a = assistant(call("x1", "view", path="a.py", line=3))
    b = assistant(call("other-id", "view", line=3, path="a.py"))
    assert same_reply(a, b)  # ids and argument order do not render
    assert not same_reply(a, assistant(call("x1", "view", path="b.py")))
    assert same_reply({"role": "assistant", "content": None}, {"role": "assistant", "content": ""})
