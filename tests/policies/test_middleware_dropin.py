"""The wrappers as drop-ins for the clients frameworks hold: attributes, ``with_options``,
conversations, streaming with directives, the verbs in the records.

Servers: ``compose_server``, a SCRIPTED Leyline server on the toy rendering (it checks that
every batch turns its cache into the request's tokens), and ``plain_server``, a stand-in
for any OpenAI server. No model, no torch; the real-server run is
``tests/serve/test_sdk_wrapper.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from leyline.policies import AsyncLeylineOpenAI, EstimateCounter, LeylineOpenAI
from leyline.policies.middleware_core import continues
from leyline.policies.middleware_wire import ChunkAccumulator

from .compose_server import ComposeServer
from .plain_server import PlainServer, plain_server
from .sse import sse
from .transcripts import Msg, assistant, call, system, tool, user, view_output

POLICY = "truncate:keep_last=1"


def turn(n: int) -> list[Msg]:
    return [assistant(call(f"c{n}", "view", path=f"f{n}.py")), tool(f"c{n}", view_output("f", n))]


def opening(task: str = "Fix the failing test.") -> list[Msg]:
    return [system(), user(task), *turn(1)]


def step(wrapper: LeylineOpenAI, history: list[Any], n: int, **options: Any) -> list[Any]:
    done = wrapper.chat.completions.create(model="toy", messages=history, **options)
    return [*history, done.choices[0].message, *turn(n)]


def test_the_client_attributes_and_resources_are_the_wrapped_clients() -> None:
    server = ComposeServer()
    client = server.openai()
    wrapper = LeylineOpenAI(client, POLICY)
    assert wrapper.base_url == client.base_url and str(wrapper.base_url).endswith("/v1/")
    assert (wrapper.api_key, wrapper.organization, wrapper.project) == ("t", None, None)
    assert (wrapper.timeout, wrapper.max_retries) == (client.timeout, 0)
    assert wrapper.models is client.models and wrapper.default_query == client.default_query
    with pytest.raises(AttributeError):
        wrapper.no_such_thing  # noqa: B018
    aclient = server.async_openai()
    assert AsyncLeylineOpenAI(aclient).api_key == "t"


def test_with_options_stays_wrapped_and_continues_the_episode() -> None:
    server = ComposeServer()
    wrapper = LeylineOpenAI(server.openai(), POLICY)
    history = step(wrapper, opening(), 2)
    retry = wrapper.with_options(max_retries=3, timeout=9.0)
    assert isinstance(retry, LeylineOpenAI) and retry is not wrapper
    assert (retry.max_retries, retry.timeout, wrapper.max_retries) == (3, 9.0, 0)
    history = step(retry, history, 3)  # a framework's retry path: same session, same records
    history = step(wrapper.copy(), history, 4)
    assert retry.records is wrapper.records and len(wrapper.records) == 3
    assert {r.session for r in wrapper.records} == {wrapper.session}
    assert [r.path for r in wrapper.records] == ["reprefill", "splice", "splice"]
    assert server.chats[1]["leyline"]["directives"]  # the copy sent the directives
    other = wrapper.with_options(base_url="http://elsewhere.test/v1")
    assert other.records == [] and other.session != wrapper.session  # another server


def test_an_unrelated_conversation_gets_a_new_session_and_no_directives() -> None:
    server = ComposeServer()
    wrapper = LeylineOpenAI(server.openai(), POLICY)
    a = step(wrapper, opening("Task A."), 2)
    a = step(wrapper, a, 3)
    first = wrapper.session
    b = step(wrapper, opening("Task B."), 2)  # same agent, another task
    record = wrapper.records[-1]
    assert record.new_conversation and record.session != first and record.directives == 0
    assert not server.chats[-1]["leyline"].get("directives")
    assert server.chats[-1]["leyline"]["session"] == record.session
    step(wrapper, b, 3)
    step(wrapper, a, 4)  # back to A: its session, its cache, spliced again
    back = wrapper.records[-1]
    assert back.session == first and not back.new_conversation and back.path == "splice"
    assert server.mismatches == []
    assert len(wrapper.records) == 5
    assert len(wrapper.conversations.episodes) == 2


def test_conversation_detection_rules() -> None:
    base = [system("S"), user("task"), assistant(text="r1"), user("more")]
    assert continues([], base)
    assert continues(base, [*base, assistant(text="r2")])  # appended
    assert continues(base, [base[0], base[1], base[3]])  # a message dropped (diff mode)
    assert continues(base, [base[0], user("skill"), *base[1:]])  # one inserted
    assert continues(base, [system("S v2"), *base[1:]])  # state in the system prompt edited
    assert not continues(base, [system("S"), user("another task")])
    assert not continues(base, [system("other agent"), user("task")])  # from scratch


def test_detection_can_be_turned_off_and_old_conversations_are_closed() -> None:
    server = ComposeServer()
    single = LeylineOpenAI(server.openai(), detect_conversations=False)
    step(single, opening("A."), 2)
    step(single, opening("B."), 2)
    assert len({r.session for r in single.records}) == 1
    limited = LeylineOpenAI(server.openai(), max_conversations=2)
    for task in "ABC":
        step(limited, opening(task), 2)
    assert len(limited.conversations.episodes) == 2
    assert [e.session for e in limited.conversations.episodes] == [
        r.session for r in limited.records[1:]
    ]


def test_records_carry_the_verbs_sent() -> None:
    server = ComposeServer()
    wrapper = LeylineOpenAI(server.openai(), "truncate:keep_last=1,mode=forget")
    history = step(wrapper, opening(), 2)
    step(wrapper, history, 3)
    record = wrapper.records[-1]
    assert record.directives == len(record.verbs) >= 1
    assert "forget" in record.verbs
    assert record.cleared_tool_uses == ("c1",) and record.cleared_tokens > 100
    assert record.to_json()["verbs"] == record.verbs


def collect(stream: Any) -> tuple[str, list[Any]]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_streaming_with_directives_on_a_leyline_server() -> None:
    server = ComposeServer()
    wrapper = LeylineOpenAI(server.openai(), POLICY)
    history = step(wrapper, opening(), 2)
    with wrapper.chat.completions.create(model="toy", messages=history, stream=True) as stream:
        assert len(wrapper.records) == 1  # nothing recorded before the stream is read
        text, chunks = collect(stream)
    assert text == "reply 2" and chunks[-1].choices[0].finish_reason == "stop"
    record = wrapper.records[-1]
    assert record.streamed and record.path == "splice" and record.verbs
    assert server.chats[-1]["stream"] is True
    assert server.chats[-1]["stream_options"] == {"include_usage": True}
    assert server.chats[-1]["leyline"]["directives"]
    # The streamed reply is tracked like a plain one: the agent replaces it by a scripted
    # call, and the next batch deletes it from the cache (else: a token mismatch).
    history += turn(3)
    history = step(wrapper, history, 4)
    assert wrapper.records[-1].path == "splice" and server.mismatches == []


def test_a_stream_left_unread_drops_the_sessions_state() -> None:
    server = ComposeServer()
    wrapper = LeylineOpenAI(server.openai(), POLICY)
    history = step(wrapper, opening(), 2)
    stream = wrapper.chat.completions.create(model="toy", messages=history, stream=True)
    next(iter(stream))  # one chunk, then the agent gives up on it
    history += [assistant(text="given up"), *turn(3)]
    step(wrapper, history, 4)
    assert not server.chats[-1]["leyline"].get("directives")  # plain messages in the session
    assert wrapper.records[-1].path in {"reprefill", "prefix_hit"}
    assert server.mismatches == []
    closed = wrapper.chat.completions.create(model="toy", messages=history, stream=True)
    closed.close()
    assert wrapper.episode.pending is None


def test_streamed_tool_calls_are_put_together() -> None:
    message = assistant(call("x1", "view", path="a.py"))
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    body = {"id": "c", "created": 1, "model": "m", "usage": usage, "leyline": {"x": 1}}
    body["choices"] = [choice]
    events = sse(body, include_usage=True, usage_apart=False).decode().split("\n\n")
    accumulator = ChunkAccumulator()
    for event in events:
        if event.startswith("data: {"):
            accumulator.add(ChatCompletionChunk.model_validate(json.loads(event[6:])))
    completion = accumulator.completion()
    (got,) = completion.choices[0].message.tool_calls or []
    assert (got.id, got.function.name, got.function.arguments) == (
        "x1",
        "view",
        json.dumps({"path": "a.py"}),
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 2
    assert (completion.model_extra or {})["leyline"] == {"x": 1}


def test_streaming_on_a_plain_server_sends_the_edited_messages() -> None:
    with plain_server() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        wrapper = LeylineOpenAI(client, POLICY)
        history: list[Any] = opening()
        for n in range(2, 5):
            stream = wrapper.chat.completions.create(model="plain", messages=history, stream=True)
            text, _ = collect(stream)
            history += [assistant(text=text), *turn(n)]
    assert [r.streamed for r in wrapper.records] == [True] * 3
    assert [r.edits for r in wrapper.records] == [0, 1, 1]
    assert all("stream_options" not in r and "leyline" not in r for r in server.requests)
    tools = [m["content"] for m in server.requests[-1]["messages"] if m["role"] == "tool"]
    assert [t.startswith("[evicted:") for t in tools] == [True, True, False]


def test_async_streaming_with_directives() -> None:
    server = ComposeServer()

    async def main() -> AsyncLeylineOpenAI:
        wrapper = AsyncLeylineOpenAI(server.async_openai(), POLICY)
        history: list[Any] = opening()
        for n in range(2, 5):
            stream = await wrapper.chat.completions.create(
                model="toy", messages=history, stream=True
            )
            async with stream:
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
            history += [assistant(text=text), *turn(n)]
        retry = wrapper.with_options(max_retries=2)
        await retry.chat.completions.create(model="toy", messages=history)
        return wrapper

    wrapper = asyncio.run(main())
    assert [r.path for r in wrapper.records] == ["reprefill", "splice", "splice", "splice"]
    assert [r.streamed for r in wrapper.records] == [True, True, True, False]
    assert server.mismatches == []


def prefix_hit_rate(requests: list[dict[str, Any]]) -> float:
    """The share of prompt characters a prefix cache would serve: for each request, its
    longest common prefix with any earlier request, over the rendered messages."""

    def rendered(body: dict[str, Any]) -> str:
        return "".join(json.dumps(m, sort_keys=True) for m in body["messages"])

    texts = [rendered(r) for r in requests]
    hit = 0
    for k, text in enumerate(texts):
        best = 0
        for earlier in texts[:k]:
            pairs = zip(text, earlier, strict=False)
            common = sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], pairs))
            best = max(best, common)
        hit += best
    return hit / sum(len(t) for t in texts)


def plain_episode(server: PlainServer, policy: str | None, turns: int) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
    wrapper = LeylineOpenAI(client, policy, counter=EstimateCounter())
    history: list[Any] = opening()
    for n in range(2, turns):
        done = wrapper.chat.completions.create(model="plain", messages=history)
        history += [done.choices[0].message, *turn(n)]


def test_prefix_cache_hit_rate_on_a_plain_server() -> None:
    """Batched clears keep a plain server's prefix cache hitting between clears: the hit
    rate of ``clear_tool_uses`` is close to no policy at all, and well above a per-turn
    trimmer (``truncate``), which rewrites the cached prefix every turn."""
    rates = {}
    for name, policy in {
        "none": None,
        "truncate": "truncate:keep_last=2",
        "clear": "clear_tool_uses:trigger=2500,keep=2",
    }.items():
        with plain_server() as server:
            plain_episode(server, policy, 16)
        rates[name] = prefix_hit_rate(server.requests)
    print(f"prefix-cache hit rates on a plain server: {rates}")
    assert rates["none"] > 0.8
    assert rates["clear"] > rates["truncate"] + 0.05, rates
    assert rates["clear"] > 0.6, rates
