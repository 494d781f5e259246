"""Summarize: old turns replaced by a summary the model writes.

The summaries here come from DETERMINISTIC stand-ins, never a model: a scripted summarizer
function for the policy alone, and for the wrappers the scripted servers of this folder
(``plain_server``: any OpenAI server; ``compose_server``: a Leyline server on the toy
rendering), whose every reply is ``reply N``. A real-model run is in
``tests/serve/test_sdk_wrapper.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from leyline.policies import (
    AsyncLeylineOpenAI,
    DropMessages,
    LeylineOpenAI,
    PolicyConfigError,
    PolicyEditError,
    ReplaceMessage,
    Summarize,
    SummaryRequest,
    Transcript,
    TurnPlanner,
    apply_to_messages,
    parse_policy,
    run_policy,
)
from leyline.policies.summarize import DEFAULT_PROMPT

from .compose_server import ComposeServer
from .plain_server import plain_server
from .transcripts import COUNTER, Msg, assistant, call, episode, system, tool, user, view_output


class Scripted:
    """A summarizer that answers ``summary 1``, ``summary 2``, ... and keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[SummaryRequest] = []

    def __call__(self, request: SummaryRequest) -> str:
        self.requests.append(request)
        return f"summary {len(self.requests)}"


def summarized(messages: list[Msg], policy: Summarize, scripted: Scripted) -> list[Msg]:
    edits = run_policy(policy, messages, counter=COUNTER, summarizer=scripted)
    return list(apply_to_messages(messages, edits).messages)


def test_the_range_runs_from_the_opening_to_the_last_kept_turns() -> None:
    messages = episode(6)  # system, task, then 6 turns of 2 messages (turn t at 2t, 2t+1)
    policy = Summarize(trigger={"messages": 13}, keep_last=2)
    assert policy.summary_range(Transcript.from_messages(messages)) == range(2, 10)
    scripted = Scripted()
    edits = run_policy(policy, messages, counter=COUNTER, summarizer=scripted)
    summary = {"role": "user", "content": "[Summary of the earlier conversation]\nsummary 1"}
    assert edits == [
        ReplaceMessage(2, summary, reason=edits[0].reason),  # type: ignore[union-attr]
        DropMessages(tuple(range(3, 10)), reason=edits[0].reason),  # type: ignore[union-attr]
    ]
    (request,) = scripted.requests
    assert request.messages == (*messages[:10], {"role": "user", "content": DEFAULT_PROMPT})
    assert (request.max_tokens, request.temperature) == (512, 0.0)


def test_below_the_trigger_nothing_and_no_request() -> None:
    scripted = Scripted()
    policy = Summarize(trigger={"messages": 14}, keep_last=2)
    assert run_policy(policy, episode(6), summarizer=scripted) == []
    assert scripted.requests == []


def test_a_later_summary_folds_the_earlier_one_and_its_own_result_is_left_alone() -> None:
    policy = Summarize(trigger={"messages": 5}, keep_last=1, prompt="Sum up.", role="system")
    scripted = Scripted()
    first = summarized(episode(4), policy, scripted)
    assert [m["role"] for m in first] == ["system", "user", "system", "assistant", "tool"]
    # Its own result: the trigger still holds, but only the summary is left to summarise.
    assert run_policy(policy, first, counter=COUNTER, summarizer=scripted) == []
    later = [*first, *episode(6)[10:]]  # two more turns
    second = summarized(later, policy, scripted)
    assert second[2]["content"] == "[Summary of the earlier conversation]\nsummary 2"
    assert len(second) == 5
    assert scripted.requests[1].messages[2] == first[2]  # summary 1 was in what it summarised
    assert scripted.requests[1].messages[-1] == {"role": "user", "content": "Sum up."}


def test_pinned_messages_end_the_range_and_calls_stay_with_their_outputs() -> None:
    messages = episode(6)
    policy = Summarize(trigger={"messages": 1}, keep_last=1)
    transcript = Transcript.from_messages(messages, pinned=[7])
    assert policy.summary_range(transcript) == range(2, 6)  # turns 1-2; turn 3 holds the pin
    custom = Summarize(trigger={"messages": 1}, keep_last=1, keep_first=3)  # inside turn 1
    assert custom.summary_range(Transcript.from_messages(messages)) == range(4, 12)


def test_without_a_summarizer_it_says_what_it_needs_and_bad_configs_are_named() -> None:
    with pytest.raises(PolicyEditError, match="needs a summarizer"):
        run_policy(Summarize(trigger={"messages": 1}), episode(4))
    with pytest.raises(PolicyConfigError, match="must contain"):
        parse_policy("summarize:template=no placeholder")
    with pytest.raises(PolicyConfigError, match="needs context_window"):
        parse_policy('summarize:trigger=["fraction",0.7]')
    round_trip = parse_policy('summarize:trigger={"tokens":900},keep_last=3,max_tokens=64')
    assert parse_policy(round_trip.model_dump(mode="json")) == round_trip


def test_the_planner_keeps_the_summary_across_turns() -> None:
    scripted = Scripted()
    planner = TurnPlanner(
        Summarize(trigger={"messages": 9}, keep_last=1), counter=COUNTER, summarizer=scripted
    )
    full = episode(8)
    sent = []
    for end in range(4, len(full) + 1, 2):
        plan = planner.plan(full[:end])
        planner.commit(plan, None)
        sent.append(plan)
    fired = [k for k, p in enumerate(sent) if p.edits]
    assert len(scripted.requests) == len(fired) >= 2
    for plan in sent[fired[0] :]:
        assert "[Summary of the earlier conversation]" in str(plan.messages[2]["content"])
        assert len(plan.messages) <= 9
    assert sent[fired[0]].cleared_tokens > 0 and sent[fired[0]].cleared_tool_uses


def turn(n: int) -> list[Msg]:
    return [assistant(call(f"c{n}", "view", path=f"f{n}.py")), tool(f"c{n}", view_output("f", n))]


POLICY = 'summarize:trigger={"messages":9},keep_last=1,prompt=Summarize.,max_tokens=40'


def test_plain_server_gets_a_summary_request_then_the_summarised_messages() -> None:
    with plain_server() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0)
        wrapper = LeylineOpenAI(client, POLICY, counter=COUNTER)
        history: list[Any] = [system(), user("Fix it."), *turn(1)]
        for n in range(2, 6):
            done = wrapper.chat.completions.create(model="plain", messages=history)
            history += [done.choices[0].message, *turn(n)]
    summaries = [r for r in server.requests if r["messages"][-1]["content"] == "Summarize."]
    assert len(summaries) >= 1
    first = server.requests.index(summaries[0])
    assert summaries[0]["max_tokens"] == 40 and summaries[0]["temperature"] == 0.0
    assert "leyline" not in summaries[0] and "tools" not in summaries[0]
    after = server.requests[first + 1]["messages"]
    assert after[2] == {
        "role": "user",
        "content": f"[Summary of the earlier conversation]\nreply {first + 1}",
    }
    assert len(after) < len(server.requests[first - 1]["messages"]) + 3
    fired = [r for r in wrapper.records if r.edits]
    assert fired and all(r.cleared_tool_uses for r in fired)


def _leyline_episode(wrapper: Any, turns: int) -> list[Any]:
    history: list[Any] = [system(), user("Fix it."), *turn(1)]
    for n in range(2, turns):
        done = wrapper.chat.completions.create(model="toy", messages=history)
        history += [done.choices[0].message, *turn(n)]
    return history


def test_on_a_leyline_server_the_summary_goes_in_as_a_splice() -> None:
    server = ComposeServer(compose=False)
    wrapper = LeylineOpenAI(server.openai(), POLICY, counter=COUNTER)
    _leyline_episode(wrapper, 7)
    fired = [r for r in wrapper.records if r.edits]
    assert fired, "the trigger was crossed"
    for record in fired:
        assert record.path == "splice" and "splice" in record.verbs and record.resync is None
    assert server.mismatches == []
    summaries = [c for c in server.chats if c["messages"][-1]["content"] == "Summarize."]
    assert summaries and all("leyline" not in c for c in summaries)


def test_async_wrapper_summarises_through_the_event_loop() -> None:
    server = ComposeServer(compose=False)

    async def main() -> AsyncLeylineOpenAI:
        async with AsyncLeylineOpenAI(server.async_openai(), POLICY, counter=COUNTER) as wrapper:
            history: list[Any] = [system(), user("Fix it."), *turn(1)]
            for n in range(2, 7):
                done = await wrapper.chat.completions.create(model="toy", messages=history)
                history += [done.choices[0].message, *turn(n)]
        return wrapper

    wrapper = asyncio.run(main())
    fired = [r for r in wrapper.records if r.edits]
    assert fired and all(r.path == "splice" for r in fired)
    assert server.mismatches == []
