"""The SDK's retention on the real `leyline serve` (SmolLM2, CPU, real HTTP): a pinned
system prompt refuses an edit, reasoning marked ``scratch`` is dropped after its turn, and
tool outputs marked ``decay`` are dropped by a server over its cache budget, mirrored by the
SDK, which goes on without a re-prefill.

The agent's turns are scripted (its tool calls and its reasoning); the model's replies, the
directives and the server's marks, drops and cache edits are real.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from leyline.policies import AsyncLeylineOpenAI, EstimateCounter, LeylineOpenAI, PinnedSpanError

from .conftest import API_KEY, Server, serve
from .test_sdk_wrapper import ask, asked_twice, opening, turn

pytestmark = [pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server with a 12 MiB cache budget (SmolLM2 keeps ~45 KB of KV a token on
    CPU): the opening of a conversation fits, two tool turns do not, so the server drops
    decay spans after the second request, and evicts only sessions without a timed pin."""
    log = tmp_path_factory.mktemp("tight") / "serve.log"
    options = ["--max-new-tokens", "4", "--max-cache-gib", str(12 / 1024)]
    with serve(log, *options, "--prefix-cache-gib", "0", "--log-level", "warning") as running:
        yield running


def wrapped(server: Server, policy: str) -> LeylineOpenAI:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    session = f"ret-{uuid.uuid4().hex[:8]}"
    return LeylineOpenAI(client, policy, session=session, counter=EstimateCounter())


def session_info(server: Server, session: str) -> dict[str, Any]:
    with server.client() as http:
        reply = http.get(f"/leyline/v1/sessions/{session}", params={"tokens": "true"})
        reply.raise_for_status()
        data: dict[str, Any] = reply.json()
        return data


def test_a_pinned_system_prompt_refuses_an_edit(server: Server) -> None:
    wrapper = wrapped(server, 'pin:roles=["system"]')
    history = asked_twice(wrapper)
    assert "pin" in wrapper.records[-1].verbs, wrapper.records[-1]
    info = session_info(server, wrapper.session)
    assert [m["verb"] for m in info["marks"]] == ["pin"]
    before = (info["revision"], info["tokens"])
    rewritten = [{"role": "system", "content": "You are a careless agent."}, *history[1:]]
    with pytest.raises(PinnedSpanError) as caught:
        ask(wrapper, [*rewritten, *turn(3)])
    assert caught.value.session == wrapper.session
    after = session_info(server, wrapper.session)
    assert (after["revision"], after["tokens"]) == before, "the session changed"
    assert len(wrapper.records) == 2, "a refused call is not recorded"
    # The episode is as it was: the same conversation goes on, on the splice path.
    history += turn(3)
    ask(wrapper, history)
    record = wrapper.records[-1]
    assert record.resync is None and record.path in ("splice", "prefix_hit"), record
    wrapper.close()


def test_the_async_wrapper_pins_as_the_sync_one_does(server: Server) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        )
        session = f"ret-{uuid.uuid4().hex[:8]}"
        policy = 'pin:roles=["system"]'
        async with AsyncLeylineOpenAI(
            client, policy, session=session, counter=EstimateCounter()
        ) as wrapper:
            history = opening("Why is the order total wrong?")
            for more in (turn(2), []):
                await wrapper.chat.completions.create(
                    model="smollm2", messages=history, max_tokens=4, temperature=0
                )
                history += more
            assert "pin" in wrapper.records[-1].verbs, wrapper.records[-1]
            return [m["verb"] for m in session_info(server, session)["marks"]]

    assert asyncio.run(main()) == ["pin"]


def test_scratch_reasoning_is_dropped_after_its_turn(server: Server) -> None:
    wrapper = wrapped(server, "scratch:keep=1")
    history = [*opening("Why is the order total wrong?")[:2], *turn(1, "look at a.py")]
    ask(wrapper, history)
    history += turn(2, "the discount is applied twice, check b.py")
    ask(wrapper, history)
    first = wrapper.records[-1]
    assert "scratch" in first.verbs and first.resync is None, first
    # Visible in its turn: the request carried the reasoning ...
    assert "<think>" in wrapper.episode.last_plan.messages[2]["content"]  # type: ignore[union-attr]
    # ... and the server dropped it when the generation completed.
    assert [(d.verb, d.message) for d in first.dropped] == [("scratch", 2)], first
    served = wrapper.planner.served[2]
    assert served["content"] == "Reading file_1.py."
    history += turn(3, "b.py confirms it")
    ask(wrapper, history)
    record = wrapper.records[-1]
    assert record.resync is None and record.plan_fallback is None, record
    assert record.path in ("splice", "prefix_hit"), record
    assert record.prompt_tokens is not None and record.prefilled_tokens is not None
    # Only the new turn was prefilled: what came before, the dropped reasoning's stub
    # included, was the session's.
    assert record.prefilled_tokens < record.prompt_tokens // 3, record
    sent = wrapper.episode.last_plan.messages  # type: ignore[union-attr]
    assert sent[2]["content"] == "Reading file_1.py."
    assert [d.message for d in record.dropped] == [4], record
    wrapper.close()


def test_decay_spans_dropped_under_pressure_are_mirrored(tight_server: Server) -> None:
    policy = 'pin:roles=["system"],ttl_s=600 | clear_tool_uses:trigger=1,keep=1,decay=true'
    wrapper = wrapped(tight_server, policy)
    history = asked_twice(wrapper)
    marked = wrapper.records[-1]
    assert "decay" in marked.verbs and "pin" in marked.verbs, marked
    # Over its budget, the server dropped the marked output when the lease ended.
    info = session_info(tight_server, wrapper.session)
    assert [d["verb"] for d in info["dropped"]] == ["decay"], info
    history += turn(3)
    ask(wrapper, history)
    record = wrapper.records[-1]
    assert [(d.verb, d.message) for d in record.dropped] == [("decay", 3)], record
    assert record.resync is None and record.plan_fallback is None, record
    assert record.path in ("splice", "prefix_hit"), record
    assert record.prefilled_tokens is not None and marked.prompt_tokens is not None
    # Everything the session held before this turn was reused, the stub included (the
    # previous prompt less what the drop took out; a few tokens of slack for the reply's
    # generation prompt): only the new turn was prefilled.
    (drop,) = record.dropped
    held = marked.prompt_tokens - drop.tokens + drop.replacement_tokens
    assert record.reused_tokens is not None and record.reused_tokens >= held - 8, record
    sent = wrapper.episode.last_plan.messages  # type: ignore[union-attr]
    assert sent[3]["content"] == "[cleared]"
    history += turn(4)
    ask(wrapper, history)
    assert wrapper.records[-1].resync is None, wrapper.records[-1]
    wrapper.close()
