"""Chat turns with directives through one ``LeylineService``, on both backends.

The reference engine runs its turns in its model scheduler (``EngineBackend.run_turn``,
real SmolLM2, generations batched); SGLang's (``SglangBackend.run_turn``) runs the edit in a
scripted scheduler and generates with a scripted generator (``scripted_scheduler``: same
ids every time, labelled as such; the live server is ``tests/live/test_chat.py``).
What the service promises must hold on both: the report says what ran, the session holds
the prompt and the reply, and a rejected request changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from leyline.core.openai_types import ChatCompletionRequest
from leyline.engine.engine import Engine
from leyline.engine.models import LoadedModel
from leyline.protocol import ErrorCode, LeylineError
from leyline.serve.service import LeylineService

from .chat_service import BACKENDS, LIMITS, chat, conversation, serving

pytestmark = [pytest.mark.model]

TOOL_OUTPUT = "\n".join(f"line {i}: the build step {i} passed in {i * 3} ms" for i in range(24))
STUB = "[tool output removed]"


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> Engine:
    return Engine(smollm2, limits=LIMITS)


@pytest.fixture(params=BACKENDS)
def service(request: pytest.FixtureRequest, engine: Engine) -> Iterator[LeylineService[Any]]:
    # "Step 3.": ids that render back as themselves
    yield from serving(request.param, engine, "Step 3.", "smollm2", max_new_tokens=4)


def _messages(tool: str, *more: dict[str, Any]) -> list[dict[str, Any]]:
    return conversation(tool, "Run the build and tell me the slowest step.", "Running it.", *more)


def state(service: LeylineService[Any], sid: str) -> tuple[tuple[int, ...], int]:
    view = service.backend.view(service.sessions.get("default", sid).handle)
    return view.tokens, view.revision


def test_a_chat_turn_splices_by_message_anchor(service: LeylineService[Any]) -> None:
    first = chat(service, _messages(TOOL_OUTPUT), session="s")
    tokens, revision = state(service, "s")
    assert first.leyline.revision == revision
    assert tokens[: first.prompt_tokens] == tuple(
        service.backend.renderer.render(
            ChatCompletionRequest.model_validate(
                {"model": "m", "messages": _messages(TOOL_OUTPUT)}
            ).messages,
            None,
            add_generation_prompt=True,
        ).tokens
    )
    assert tokens[first.prompt_tokens :] == first.generation.tokens  # the reply is held

    edited = _messages(STUB, {"role": "assistant", "content": first.content})
    edited.append({"role": "user", "content": "And the fastest?"})
    directive = {"verb": "splice", "span": {"message": 3, "part": "content"}, "replacement": STUB}
    second = chat(service, edited, session="s", base_revision=revision, directives=[directive])
    ley = second.leyline
    summary = str(ley.model_dump(exclude={"spans"}))
    assert ley.path.value == "splice" and ley.fallback_reason is None, summary
    assert ley.rotated_tokens > 0
    assert ley.reused_tokens + ley.prefilled_tokens == second.prompt_tokens
    assert ley.prefilled_tokens < second.prompt_tokens // 2  # the point of splicing
    after, after_revision = state(service, "s")
    assert after_revision == ley.revision > revision
    assert after[second.prompt_tokens :] == second.generation.tokens


def test_a_rejected_chat_turn_changes_nothing(service: LeylineService[Any]) -> None:
    chat(service, _messages(TOOL_OUTPUT), session="r")
    before = state(service, "r")
    stale = {"verb": "splice", "span": {"message": 3, "part": "content"}, "replacement": STUB}
    for leyline, code in [
        ({"base_revision": before[1] - 1, "directives": [stale]}, ErrorCode.revision_conflict),
        ({"base_revision": before[1] - 1}, ErrorCode.revision_conflict),  # a stale extension
        ({"base_revision": before[1], "directives": [stale | {"span": {"message": 9}}]},
         ErrorCode.unresolved_anchor),
    ]:  # fmt: skip
        with pytest.raises(LeylineError) as info:
            chat(service, _messages(STUB), session="r", **leyline)
        assert info.value.code is code
        assert state(service, "r") == before
    with pytest.raises(LeylineError) as info:
        chat(service, _messages(STUB), session="new", directives=[stale], base_revision=0)
    assert info.value.code is ErrorCode.unknown_session
    assert not service.sessions.exists("default", "new")


def test_require_session_refuses_an_unknown_session_and_creates_none(
    service: LeylineService[Any],
) -> None:
    assert service.capabilities().require_session is True
    required = {"options": {"require_session": True}}
    with pytest.raises(LeylineError) as info:
        chat(service, _messages(TOOL_OUTPUT), session="lost", **required)
    error = info.value
    assert (error.code, error.http_status, error.field) == (
        ErrorCode.unknown_session,
        404,
        "leyline.session",
    )
    assert not service.sessions.exists("default", "lost")
    # Without the option the same turn creates it (and prefills the whole prompt)...
    first = chat(service, _messages(TOOL_OUTPUT), session="lost")
    assert service.sessions.exists("default", "lost")
    assert first.leyline.prefilled_tokens == first.prompt_tokens
    # ... and with it a session that exists runs the turn as before, on its cached prefix.
    more = _messages(TOOL_OUTPUT, {"role": "assistant", "content": first.content})
    more.append({"role": "user", "content": "And the fastest?"})
    second = chat(service, more, session="lost", **required)
    assert second.leyline.session == "lost"
    assert second.leyline.reused_tokens >= first.prompt_tokens


def test_require_session_without_a_session_is_refused(service: LeylineService[Any]) -> None:
    with pytest.raises(LeylineError) as info:
        chat(service, _messages(TOOL_OUTPUT), options={"require_session": True})
    assert info.value.code is ErrorCode.invalid_directive
    assert info.value.field == "leyline.session"
    assert len(service.sessions) == 0
