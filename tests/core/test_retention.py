"""PIN, DECAY and SCRATCH on the session core, held by both backends (docs/protocol.md, 3.5).

Each test runs on the reference engine (real SmolLM2 weights, ``EngineBackend``) and on the
SGLang backend over a scripted scheduler and a scripted generator (same ids every time,
labelled as such in ``scripted_scheduler``). The expected token sequences come from the
protocol's edit algebra applied to what the session held, not from the server's report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from leyline.core.salted_session import SaltedSession
from leyline.engine.engine import Engine
from leyline.engine.models import LoadedModel
from leyline.protocol import Edit, ErrorCode, LeylineError, Mode, apply_edits
from leyline.protocol.resources import ApplyDirectives
from leyline.serve.service import LeylineService
from leyline.sglang.backend import SglangBackend

from .chat_service import BACKENDS, LIMITS, chat, conversation, make_service

pytestmark = [pytest.mark.model]

TOOL_OUTPUT = "\n".join(f"line {i}: step {i} passed in {i * 3} ms" for i in range(20))
STUB = "[cleared]"


class WeighedSglang(SglangBackend):
    """SGLang's tree owns its KV (``nbytes`` is 0), so the byte budget never binds there;
    this one weighs a session by its tokens, to drive the store's budget on both."""

    def nbytes(self, handle: SaltedSession) -> int:
        return 1000 * len(handle.view.tokens)


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> Engine:
    return Engine(smollm2, limits=LIMITS)


def make(kind: str, engine: Engine, **settings: Any) -> tuple[LeylineService[Any], Any]:
    return make_service(kind, engine, "Done.", "m", WeighedSglang, max_new_tokens=3, **settings)


@pytest.fixture(params=BACKENDS)
def service(request: pytest.FixtureRequest, engine: Engine) -> Iterator[LeylineService[Any]]:
    svc, backend = make(request.param, engine)
    yield svc
    if request.param == "engine":
        backend.shutdown()


def messages(tool: str = TOOL_OUTPUT, *more: dict[str, Any]) -> list[dict[str, Any]]:
    return conversation(tool, "Run the build.", "Running it now, one moment.", *more)


def apply(service: LeylineService[Any], sid: str, *directives: dict[str, Any]) -> Any:
    revision = info(service, sid).revision
    body = ApplyDirectives.model_validate({"base_revision": revision, "directives": directives})
    return asyncio.run(service.core.apply("default", sid, body))


def info(service: LeylineService[Any], sid: str) -> Any:
    return asyncio.run(service.core.get("default", sid, include_tokens=True))


def code_of(action: Any) -> ErrorCode:
    with pytest.raises(LeylineError) as caught:
        action()
    return caught.value.code


def chat_code(service: LeylineService[Any], sid: str, revision: int) -> ErrorCode:
    return code_of(lambda: chat(service, messages(), session=sid, base_revision=revision))


def content(service: LeylineService[Any], sid: str, message: int) -> tuple[int, int]:
    span = info(service, sid).spans[message].content
    return span.start, span.end


def test_a_pin_refuses_what_touches_it_and_moves_with_edits_elsewhere(
    service: LeylineService[Any],
) -> None:
    chat(service, messages(), session="s")
    tool = content(service, "s", 3)
    pinned = apply(service, "s", {"verb": "pin", "span": {"message": 3, "part": "content"}})
    before = info(service, "s")
    assert pinned.revision == before.revision  # marks change no token
    assert [(m.verb, m.start, m.end) for m in before.marks] == [("pin", *tool)]
    pinned_tokens = before.tokens[tool[0] : tool[1]]

    splice = {"verb": "splice", "span": {"start": tool[0] + 2, "end": tool[0] + 5}}
    assert code_of(lambda: apply(service, "s", splice | {"replacement": "x"})) is (
        ErrorCode.pinned_span
    )
    decay = {"verb": "decay", "span": {"message": 3}}
    assert code_of(lambda: apply(service, "s", decay)) is ErrorCode.pinned_span
    rewrite = messages("a different tool output")  # re-prefills over the pin: an edit too
    assert code_of(lambda: chat(service, rewrite, session="s")) is ErrorCode.pinned_span
    assert info(service, "s") == before  # nothing changed, marks included

    # An edit upstream moves the pin with its tokens.
    apply(service, "s", {"verb": "splice", "span": {"message": 2, "part": "content"},
                         "replacement": STUB})  # fmt: skip
    after = info(service, "s")
    (pin,) = after.marks
    assert after.tokens[pin.start : pin.end] == pinned_tokens
    assert pin.start < tool[0]

    apply(service, "s", {"verb": "unpin", "span": {"start": pin.start, "end": pin.start + 1}})
    assert info(service, "s").marks == []
    apply(service, "s", splice | {"replacement": "x"})  # unpinned: edits run again


def test_a_scratch_span_is_dropped_when_the_turn_that_follows_ends(
    service: LeylineService[Any],
) -> None:
    first = chat(service, messages(), session="t")
    held = info(service, "t")
    start, end = content(service, "t", 2)  # the assistant's "thinking"
    follow = messages(TOOL_OUTPUT, {"role": "assistant", "content": first.content},
                      {"role": "user", "content": "Which step was slowest?"})  # fmt: skip
    scratch = {"verb": "scratch", "span": {"message": 2, "part": "content"}}
    reply = chat(service, follow, session="t", base_revision=held.revision, directives=[scratch])

    (dropped,) = reply.leyline.dropped
    assert (dropped.verb, dropped.start, dropped.end) == ("scratch", start, end)
    after = info(service, "t")
    assert reply.leyline.revision == after.revision == dropped.revision
    # The turn saw the span; the session now holds the turn (prompt and reply) without it.
    generated = tuple(reply.generation.tokens)
    assert len(after.tokens) == reply.prompt_tokens + len(generated) - (end - start)
    assert after.tokens[:start] == held.tokens[:start]
    assert tuple(after.tokens[len(after.tokens) - len(generated) :]) == generated
    assert after.marks == [] and after.spans == reply.leyline.spans
    assert [s.message for s in after.spans] == list(range(len(follow)))
    # Reported once: the next response has nothing more to say.
    again = chat(service, follow[:2], session="other")
    assert again.leyline.dropped == []


@pytest.mark.parametrize("kind", ["engine", "sglang"])
def test_decay_spans_go_before_any_session_and_the_next_response_says_so(
    kind: str, engine: Engine
) -> None:
    probe, backend = make(kind, engine)
    chat(probe, messages(), session="p")
    weight = backend.nbytes(probe.sessions.get("default", "p").handle)
    if kind == "engine":
        backend.shutdown()
    # Room for two such sessions, not three.
    service, backend = make(kind, engine, max_cache_bytes=int(weight * 2.5))
    try:
        first = chat(service, messages(), session="a")
        tool = content(service, "a", 3)
        apply(service, "a", {"verb": "decay", "span": {"message": 3, "part": "content"},
                             "priority": 1, "mode": "amortize", "replacement": STUB})  # fmt: skip
        held_a = info(service, "a")
        chat(service, messages(), session="b")
        apply(service, "b", {"verb": "decay", "span": {"message": 3, "part": "content"},
                             "priority": 5})  # fmt: skip
        chat(service, messages(), session="c")  # over budget: a's decay (priority 1) goes first

        assert service.sessions.ids() == ["a", "b", "c"]  # nobody evicted
        a = info(service, "a")
        stub = backend.encode(STUB)
        expected = apply_edits(held_a.tokens, [Edit(*tool, tuple(stub), Mode.amortize)]).tokens
        assert tuple(a.tokens) == expected and a.revision == held_a.revision + 1
        assert a.marks == [] and [m.verb for m in info(service, "b").marks] == ["decay"]
        # A client holding the old revision is refused and can read what was dropped.
        stale = chat_code(service, "a", held_a.revision)
        assert stale is ErrorCode.revision_conflict
        assert [(d.verb, d.start, d.end) for d in info(service, "a").dropped] == [("decay", *tool)]
        follow = messages(STUB, {"role": "assistant", "content": first.content},
                          {"role": "user", "content": "And then?"})  # fmt: skip
        reply = chat(service, follow, session="a", base_revision=a.revision)
        (dropped,) = reply.leyline.dropped
        assert (dropped.verb, dropped.start, dropped.end) == ("decay", *tool)
        assert dropped.replacement_tokens == len(stub) and dropped.revision == a.revision
        # The client mirrored the drop: everything the session holds is reused (the
        # amortized drop kept the downstream KV).
        assert reply.leyline.path.value == "prefix_hit"
        assert reply.leyline.reused_tokens >= len(a.tokens) - 1
    finally:
        if kind == "engine":
            backend.shutdown()


@pytest.mark.parametrize("kind", ["engine", "sglang"])
def test_pinned_sessions_are_evicted_last_and_never_within_their_ttl(
    kind: str, engine: Engine
) -> None:
    service, backend = make(kind, engine, max_sessions=2)
    try:
        chat(service, messages(), session="timed")
        apply(service, "timed", {"verb": "pin", "span": {"message": 0}, "ttl_s": 600})
        chat(service, messages(), session="plain")
        chat(service, messages(), session="new")  # evicts "plain", not the older "timed"
        assert sorted(service.sessions.ids()) == ["new", "timed"]
        apply(service, "new", {"verb": "pin", "span": {"message": 0}, "ttl_s": 600})
        with pytest.raises(LeylineError) as caught:
            chat(service, messages(), session="third")  # both pinned with time left
        assert caught.value.code is ErrorCode.limit_exceeded
        assert sorted(service.sessions.ids()) == ["new", "timed"]
        later = time.time() + 601
        service.sessions.clock = lambda: later  # both ttls ran out: ordinary sessions again
        chat(service, messages(), session="third")
        assert "third" in service.sessions.ids() and len(service.sessions) == 2
    finally:
        if kind == "engine":
            backend.shutdown()
