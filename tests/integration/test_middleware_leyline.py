"""The OpenAI-client wrappers against the real `leyline serve` (SmolLM2, CPU, real HTTP).

The agent's tool calls are scripted; the model's replies, the policy, the directives and
the server's cache edits are real.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from leyline.policies import AsyncLeylineOpenAI, CallRecord, LeylineOpenAI

from .flaky_proxy import flaky_proxy

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.model]

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def output(n: int, lead: str = "") -> str:
    lines = [f"{lead}{i:>3} | total = price * quantity - discount_{n}_{i}" for i in range(14)]
    return f"{lead}file_{n}.py ({len(lines)} lines)\n" + "\n".join(lines)


def turn(n: int, lead: str = "") -> list[dict[str, Any]]:
    arguments = json.dumps({"path": f"file_{n}.py"})
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{n}",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": f"call_{n}", "content": output(n, lead)},
    ]


def opening() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent. Read files, then answer."},
        {"role": "user", "content": "Why is the order total wrong?"},
    ]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="test", max_retries=0)


def ask(wrapper: LeylineOpenAI, messages: list[Any], tools: list[Any] | None = TOOLS) -> CallRecord:
    options: dict[str, Any] = {"tools": tools} if tools else {}
    wrapper.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=4, temperature=0, **options
    )
    return wrapper.records[-1]


def scripted(wrapper: LeylineOpenAI, turns: int, lead: str = "") -> list[dict[str, Any]]:
    """The agent replaces each reply by its next scripted call (the reply is not sent)."""
    messages = opening()
    for n in range(1, turns + 1):
        messages += turn(n, lead)
        ask(wrapper, messages)
    return messages


def session_tokens(base_url: str, session: str) -> list[int]:
    root = base_url.removesuffix("/v1")
    info = httpx.get(f"{root}/leyline/v1/sessions/{session}", params={"tokens": "true"})
    tokens: list[int] = info.json()["tokens"]
    return tokens


def rendered(base_url: str, messages: list[Any]) -> list[int]:
    root = base_url.removesuffix("/v1")
    body = {"messages": messages, "tools": TOOLS, "add_generation_prompt": True}
    tokens: list[int] = httpx.post(f"{root}/leyline/v1/tokenize", json=body).json()["tokens"]
    return tokens


def assert_spliced(record: CallRecord) -> None:
    assert record.path == "splice", record
    assert record.fallback_reason is None and record.resync is None, record
    assert record.directives >= 1 and (record.rotated_tokens or 0) > 0, record


def test_policy_edits_run_as_splices_and_leave_exactly_the_sent_tokens(leyline_url: str) -> None:
    spliced = LeylineOpenAI(client(leyline_url), "truncate:keep_last=1")
    scripted(spliced, 4)
    assert [r.leyline for r in spliced.records] == [True] * 4
    assert spliced.records[0].path == "reprefill" and spliced.records[0].edits == 0  # fresh
    for record in spliced.records[1:]:
        assert_spliced(record)
        assert record.edits == 1
    # The cache holds exactly the tokens of the messages sent (then the generated reply).
    sent = spliced.episode.last_plan.messages  # type: ignore[union-attr]
    prompt = rendered(leyline_url, list(sent))
    assert session_tokens(leyline_url, spliced.session)[: len(prompt)] == prompt

    baseline = LeylineOpenAI(client(leyline_url), "truncate:keep_last=1", directives=False)
    scripted(baseline, 4)
    assert [r.directives for r in baseline.records] == [0] * 4
    assert [r.path for r in baseline.records[1:]] == ["reprefill"] * 3
    for s, b in zip(spliced.records[1:], baseline.records[1:], strict=True):
        assert s.prompt_tokens == b.prompt_tokens  # the same messages went out
        assert (s.prefilled_tokens or 0) < (b.prefilled_tokens or 0)
    spliced.close()
    baseline.close()


def test_diff_mode_turns_the_agents_own_rewrite_into_a_splice(leyline_url: str) -> None:
    wrapper = LeylineOpenAI(client(leyline_url))  # no policy
    messages: list[Any] = [*opening(), *turn(1), *turn(2)]
    completion = wrapper.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=4, temperature=0
    )
    # A real agent loop: the model's reply goes back; the agent drops an old output itself.
    messages.append(completion.choices[0].message)
    messages[3] = {**messages[3], "content": "[the agent dropped file_1.py]"}
    messages.append({"role": "user", "content": "Go on."})
    record = ask(wrapper, messages, tools=None)
    assert_spliced(record)
    assert record.edits == 0 and record.directives == 1  # inferred; the reply was sent back


def test_async_wrapper_splices(leyline_url: str) -> None:
    async def episode() -> list[CallRecord]:
        aclient = openai.AsyncOpenAI(base_url=leyline_url, api_key="test", max_retries=0)
        async with AsyncLeylineOpenAI(aclient, "truncate:keep_last=1") as wrapper:
            messages = opening()
            for n in range(1, 4):
                messages += turn(n)
                await wrapper.chat.completions.create(
                    model="smollm2", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
                )
        return wrapper.records

    records = asyncio.run(episode())
    assert records[0].path == "reprefill"  # a fresh session reuses nothing
    for record in records[1:]:
        assert_spliced(record)


def test_a_revision_conflict_resyncs_and_the_next_turn_splices(leyline_url: str) -> None:
    wrapper = LeylineOpenAI(client(leyline_url), "truncate:keep_last=1")
    messages = scripted(wrapper, 2)
    # Someone else moves the session on behind the wrapper's back.
    other = client(leyline_url).chat.completions.create(
        model="smollm2",
        messages=list(wrapper.planner.served),  # type: ignore[arg-type]
        tools=TOOLS,
        max_tokens=2,
        extra_body={"leyline": {"session": wrapper.session}},
    )
    assert other.model_extra and other.model_extra["leyline"]["revision"] > wrapper.planner.revision
    messages += turn(3)
    record = ask(wrapper, messages)
    assert record.resync == "revision_conflict" and record.directives == 0
    assert record.path == "reprefill" and (record.reused_tokens or 0) > 0
    messages += turn(4)
    assert_spliced(ask(wrapper, messages))


def test_a_lost_session_resyncs_and_the_next_turn_splices(leyline_url: str) -> None:
    wrapper = LeylineOpenAI(client(leyline_url), "truncate:keep_last=1")
    messages = scripted(wrapper, 2)
    root = leyline_url.removesuffix("/v1")
    lost = wrapper.session
    assert httpx.delete(f"{root}/leyline/v1/sessions/{lost}").status_code == 204
    messages += turn(3)
    record = ask(wrapper, messages)
    # The episode goes on in a new session (a router would bind it anew), prefilled whole.
    assert record.resync == "session_lost" and record.lost_session == lost
    assert wrapper.session == f"{lost}~1" and record.reused_tokens == 0
    messages += turn(4)
    assert_spliced(ask(wrapper, messages))


def test_a_server_error_on_a_directive_request_resyncs(leyline_url: str) -> None:
    with flaky_proxy(leyline_url.removesuffix("/v1")) as proxy:
        wrapper = LeylineOpenAI(client(proxy.base_url), "truncate:keep_last=1")
        messages = scripted(wrapper, 2)
        proxy.fail_directives = 1
        messages += turn(3)
        record = ask(wrapper, messages)
        assert proxy.failed == 1
        assert record.resync == "HTTP 503" and record.directives == 0
        messages += turn(4)
        assert_spliced(ask(wrapper, messages))


def test_stubbing_an_output_that_starts_with_whitespace_splices(leyline_url: str) -> None:
    wrapper = LeylineOpenAI(client(leyline_url), "truncate:keep_last=1")
    scripted(wrapper, 3, lead="  ")
    for record in wrapper.records[1:]:
        assert_spliced(record)
