"""The session core's contract, held by both backends through the same service.

Each test runs twice: on the reference engine (real SmolLM2 weights) and on the SGLang
backend over a scripted scheduler (``scripted_scheduler``; SGLang's real classes are in
``tests/sglang``, a live server in ``tests/live``). A rule that lives in the core
(revisions, spans, limits, tenants, nothing created or changed by a rejected request)
must hold on both; the old SGLang service without a revision check fails these tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from leyline.core.openai_types import parse_chat
from leyline.core.service import SessionService
from leyline.core.sessions import SessionStore
from leyline.engine.backend import EngineBackend
from leyline.engine.engine import Engine
from leyline.engine.models import LoadedModel
from leyline.protocol import ErrorCode, LeylineError, Limits, Path, Verb
from leyline.protocol.algebra import Edit, apply_edits
from leyline.protocol.directives import (
    ComposeDirective,
    ErratumDirective,
    ForgetDirective,
    PinDirective,
    SpliceDirective,
)
from leyline.protocol.resources import (
    ApplyDirectives,
    SessionCreate,
    SkillCreate,
    skill_content_hash,
)
from leyline.protocol.spans import MessageAnchor, TokenSpan
from leyline.sglang.backend import SglangBackend

from .scripted_scheduler import ScriptedScheduler

pytestmark = [pytest.mark.model]

LIMITS = Limits(
    max_directives=4, max_replacement_tokens=64, max_session_tokens=512, max_skill_tokens=256
)
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Read the file notes.txt for me."},
    {"role": "assistant", "content": "It says: the meeting moved to Thursday at noon."},
    {"role": "user", "content": "When is the meeting?"},
]
A, B = "tenant-a", "tenant-b"


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> Engine:
    return Engine(smollm2, limits=LIMITS)


@pytest.fixture(params=["engine", "sglang"])
def service(request: pytest.FixtureRequest, engine: Engine) -> Iterator[SessionService[Any]]:
    if request.param == "engine":
        backend: Any = EngineBackend(engine, limits=LIMITS, model_name="smollm2")
        yield SessionService(backend, SessionStore(backend, max_sessions=3))
        backend.shutdown()
    else:
        scheduler = ScriptedScheduler()
        backend = SglangBackend(
            scheduler, engine.tokenizer, limits=LIMITS, vocab_size=engine.vocab_size
        )
        yield SessionService(backend, SessionStore(backend, max_sessions=3))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def create(service: SessionService[Any], tenant: str = A, **body: Any) -> Any:
    return run(service.create(tenant, SessionCreate.model_validate(body)))


def apply(service: SessionService[Any], session: str, base: int, *directives: Any) -> Any:
    body = ApplyDirectives(base_revision=base, directives=list(directives))
    return run(service.apply(A, session, body))


def state(service: SessionService[Any], session: str, tenant: str = A) -> Any:
    return run(service.get(tenant, session, include_tokens=True))


def code_of(action: Any) -> ErrorCode:
    with pytest.raises(LeylineError) as info:
        action()
    return info.value.code


def test_a_message_anchor_splices_and_the_spans_follow(service: SessionService[Any]) -> None:
    info = create(service, session="s", messages=MESSAGES)
    assert info.revision == 1 and len(info.spans) == len(MESSAGES)
    before = state(service, "s")
    stub = service.backend.encode("[stale]")
    splice = SpliceDirective(span=MessageAnchor(message=2, part="content"), replacement=stub)
    response = apply(service, "s", before.revision, splice)
    assert response.revision == before.revision + 1
    after = state(service, "s")
    content = before.spans[2].content
    expected = apply_edits(before.tokens, [Edit(content.start, content.end, tuple(stub))])
    assert tuple(after.tokens) == expected.tokens
    assert [s.message for s in after.spans] == [0, 1, 2, 3]
    new_content = after.spans[2].content
    assert after.tokens[new_content.start : new_content.end] == list(stub)
    assert after.spans[3].end == len(after.tokens)


def test_a_stale_revision_is_a_conflict_and_changes_nothing(
    service: SessionService[Any],
) -> None:
    create(service, session="s", tokens=list(range(10, 60)))
    before = state(service, "s")
    splice = SpliceDirective(span=TokenSpan(start=5, end=9))
    assert apply(service, "s", before.revision, splice).revision == before.revision + 1
    # A second client still holding the old revision: refused, nothing lost.
    after_first = state(service, "s")
    assert code_of(lambda: apply(service, "s", before.revision, splice)) is (
        ErrorCode.revision_conflict
    )
    assert state(service, "s") == after_first


@pytest.mark.parametrize(
    ("directive", "code"),
    [
        (SpliceDirective(span=TokenSpan(start=0, end=99)), ErrorCode.invalid_span),
        (PinDirective(span=TokenSpan(start=3, end=3)), ErrorCode.invalid_span),
        (
            SpliceDirective(span=TokenSpan(start=0, end=3), replacement=[5] * 65),
            (ErrorCode.replacement_too_long),
        ),
        (
            SpliceDirective(span=TokenSpan(start=0, end=3), replacement=[10**7]),
            (ErrorCode.invalid_directive),
        ),
        (SpliceDirective(span=MessageAnchor(message=9)), ErrorCode.unresolved_anchor),
    ],
)
def test_rejected_batches_change_nothing(
    service: SessionService[Any], directive: Any, code: ErrorCode
) -> None:
    create(service, session="s", tokens=list(range(10, 60)))
    before = state(service, "s")
    assert code_of(lambda: apply(service, "s", before.revision, directive)) is code
    assert state(service, "s") == before


def test_a_rejected_create_creates_nothing(service: SessionService[Any]) -> None:
    too_long = list(range(10, 10 + LIMITS.max_session_tokens + 1))  # type: ignore[operator]
    assert code_of(lambda: create(service, session="x", tokens=too_long)) is (
        ErrorCode.session_too_long
    )
    assert code_of(lambda: create(service, session="y", tokens=[1, 10**7])) is (
        ErrorCode.invalid_directive
    )
    assert len(service.store) == 0
    create(service, session="x", tokens=[1, 2, 3])  # the id is free: nothing was kept
    assert code_of(lambda: create(service, session="x")) is ErrorCode.invalid_directive


def test_sessions_belong_to_their_tenant(service: SessionService[Any]) -> None:
    create(service, A, session="1", tokens=[5, 6, 7])
    splice = ApplyDirectives(
        base_revision=1, directives=[ForgetDirective(span=TokenSpan(start=0, end=1))]
    )
    for action in (
        lambda: run(service.get(B, "1")),
        lambda: run(service.apply(B, "1", splice)),
        lambda: run(service.delete(B, "1")),
    ):
        assert code_of(action) is ErrorCode.unknown_session
    # Tenant B may use the same id for a session of its own; A's is untouched.
    create(service, B, session="1", tokens=[9])
    assert state(service, "1", A).tokens == [5, 6, 7]
    assert state(service, "1", B).tokens == [9]


def test_forget_and_erratum_report_their_paths(service: SessionService[Any]) -> None:
    create(service, session="s", tokens=list(range(10, 60)))
    forget = apply(service, "s", 1, ForgetDirective(span=TokenSpan(start=20, end=30)))
    assert forget.path is Path.reprefill and forget.revision == 2
    assert state(service, "s").tokens == [*range(10, 30), *range(40, 60)]
    erratum = apply(service, "s", 2, ErratumDirective(text=[7, 8]))
    assert erratum.revision == 3
    assert state(service, "s").tokens[-2:] == [7, 8]


def test_concurrent_writes_to_one_revision_one_wins(service: SessionService[Any]) -> None:
    create(service, session="s", tokens=list(range(10, 60)))

    async def race() -> list[Any]:
        body = ApplyDirectives(
            base_revision=1, directives=[SpliceDirective(span=TokenSpan(start=3, end=8))]
        )
        return await asyncio.gather(
            *(service.apply(A, "s", body) for _ in range(4)), return_exceptions=True
        )

    outcomes = run(race())
    wins = [o for o in outcomes if not isinstance(o, BaseException)]
    losses = [o for o in outcomes if isinstance(o, LeylineError)]
    assert len(wins) == 1 and len(losses) == 3
    assert {e.code for e in losses} == {ErrorCode.revision_conflict}
    assert state(service, "s").revision == 2


def test_a_request_waiting_on_a_deleted_session_is_told(service: SessionService[Any]) -> None:
    create(service, session="s", tokens=list(range(10, 60)))

    async def race() -> list[Any]:
        body = ApplyDirectives(
            base_revision=1, directives=[SpliceDirective(span=TokenSpan(start=3, end=8))]
        )
        delete = service.delete(A, "s")
        later = service.apply(A, "s", body)
        return await asyncio.gather(delete, later, return_exceptions=True)

    deleted, later = run(race())
    assert deleted is None
    assert isinstance(later, LeylineError) and later.code is ErrorCode.unknown_session
    assert len(service.store) == 0


def test_the_count_limit_evicts_idle_sessions_first(service: SessionService[Any]) -> None:
    for name in ("a", "b", "c", "d"):
        create(service, session=name, tokens=[1, 2, 3])
    assert service.store.ids(A) == ["b", "c", "d"]  # "a" was least recently used
    assert code_of(lambda: run(service.get(A, "a"))) is ErrorCode.unknown_session


def test_a_bad_message_is_named_by_its_full_path(service: SessionService[Any]) -> None:
    bad = [MESSAGES[0], {"role": "wizard", "content": "abracadabra"}]
    with pytest.raises(LeylineError) as info:
        create(service, session="m", messages=bad)
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_directive, "messages[1].role")
    assert len(service.store) == 0


def test_a_session_from_messages_can_end_with_the_generation_prompt(
    service: SessionService[Any],
) -> None:
    plain = create(service, session="p", messages=MESSAGES)
    ready = create(service, session="g", messages=MESSAGES, add_generation_prompt=True)
    chat, _ = parse_chat(MESSAGES)
    want = service.backend.renderer.render(chat, None, add_generation_prompt=True).tokens
    assert tuple(state(service, "g").tokens) == want
    assert ready.num_tokens > plain.num_tokens
    assert tuple(state(service, "g").tokens[: plain.num_tokens]) == tuple(
        state(service, "p").tokens
    )
    with pytest.raises(ValueError, match="needs messages"):
        SessionCreate(text="hi", add_generation_prompt=True)


def test_a_session_that_cannot_be_kept_is_refused_not_created(engine: Engine) -> None:
    backend = EngineBackend(engine, limits=LIMITS, model_name="smollm2")
    try:
        service = SessionService(backend, SessionStore(backend, max_cache_bytes=64 * 1024))
        code = code_of(lambda: create(service, session="big", tokens=list(range(10, 60))))
        assert code is ErrorCode.limit_exceeded
        assert len(service.store) == 0
    finally:
        backend.shutdown()


def test_compose_inserts_a_registered_skill_and_reports_its_seam_as_prefilled(
    service: SessionService[Any],
) -> None:
    create(service, session="s", tokens=list(range(10, 60)))
    before = state(service, "s")
    body = SkillCreate(skill="rules", tokens=list(range(100, 120)))
    compose = ComposeDirective(skill="rules", at=7, seam_tokens=3)
    assert Verb.compose in service.capabilities().verbs  # both backends compose
    info = run(service.create_skill(A, body))
    assert info.num_tokens == 20
    assert code_of(lambda: run(service.get_skill(B, "rules", False))) is ErrorCode.unknown_skill
    response = apply(service, "s", before.revision, compose)
    assert response.path is Path.splice
    assert [(b.start, b.end) for b in response.composed] == [(7, 27)]
    new = [*range(10, 17), *range(100, 120), *range(17, 60)]
    assert state(service, "s").tokens == new
    # The seam is computed; the rest of the block and everything else is reused.
    assert (response.reused_tokens, response.prefilled_tokens) == (len(new) - 3, 3)
    # A deleted skill is unknown to the next compose, which changes nothing.
    run(service.delete_skill(A, "rules"))
    after = state(service, "s")
    gone = ComposeDirective(skill="rules", at=0)
    assert code_of(lambda: apply(service, "s", after.revision, gone)) is ErrorCode.unknown_skill
    assert state(service, "s") == after


def test_an_anchored_skill_is_kept_with_its_anchor_or_refused_with_nothing_kept(
    service: SessionService[Any],
) -> None:
    """``SkillCreate.anchor``: where the capabilities say ``skill_anchors``, the block is
    kept with its anchor (the anchored content hash, the anchor read back); every bad
    anchor is refused with its own code and field, and no skill is left behind."""
    block, lead = list(range(100, 120)), list(range(30, 36))
    body = SkillCreate(skill="anchored", tokens=block, anchor={"tokens": lead})  # type: ignore[arg-type]
    caps = service.capabilities()
    assert Verb.compose in caps.verbs and caps.skill_anchors
    bad_anchors = [
        ({"tokens": [10**7]}, ErrorCode.invalid_directive, "anchor.tokens"),
        ({"tokens": list(range(10, 10 + 500))}, ErrorCode.limit_exceeded, "tokens"),
    ]
    for anchor, code, field in bad_anchors:
        bad = SkillCreate(skill="bad-anchor", tokens=block, anchor=anchor)  # type: ignore[arg-type]
        with pytest.raises(LeylineError) as refused:
            run(service.create_skill(A, bad))
        assert (refused.value.code, refused.value.field) == (code, field)
        assert code_of(lambda: run(service.get_skill(A, "bad-anchor", False))) is (
            ErrorCode.unknown_skill
        )
    info = run(service.create_skill(A, body))
    assert (info.num_tokens, info.anchor_tokens) == (20, 6)
    assert info.content_hash == skill_content_hash(info.model, block, lead)
    assert info.content_hash != skill_content_hash(info.model, block)
    read = run(service.get_skill(A, "anchored", True))
    assert read.tokens == block and read.anchor == lead
    plain = run(service.create_skill(A, SkillCreate(skill="anchored", tokens=block)))
    assert plain.anchor_tokens == 0 and plain.content_hash == skill_content_hash(info.model, block)
    assert run(service.get_skill(A, "anchored", True)).anchor is None  # replaced


def test_an_anchor_is_unsupported_where_keys_cannot_be_rotated() -> None:
    """Dynamic NTK RoPE: an anchored block's keys cannot be turned back to position 0, so
    the capabilities say ``skill_anchors: false`` and an anchor is ``unsupported_option``."""
    from tests.engine._helpers import tiny_llama

    engine = Engine(tiny_llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    backend = EngineBackend(engine, limits=Limits(), model_name="tiny-dynamic")
    try:
        service = SessionService(backend, SessionStore(backend))
        assert not service.capabilities().skill_anchors
        body = SkillCreate(skill="anchored", tokens=[5, 6, 7], anchor={"tokens": [3, 4]})  # type: ignore[arg-type]
        with pytest.raises(LeylineError) as refused:
            run(service.create_skill(A, body))
        assert (refused.value.code, refused.value.field) == (ErrorCode.unsupported_option, "anchor")
        assert run(service.list_skills(A)).skills == []
        assert (
            run(service.create_skill(A, SkillCreate(skill="plain", tokens=[5, 6]))).num_tokens == 2
        )
    finally:
        backend.shutdown()


def test_labels_of_skills_the_store_evicted_are_dropped() -> None:
    """The skill store evicts on its own under its byte budget; the backend's labels (name,
    description) must go with the skills, or they grow with every id ever registered."""
    from tests.engine._helpers import tiny_llama

    engine = Engine(tiny_llama({"rope_type": "default", "rope_theta": 10000.0}))
    # A budget of about one three-token skill: each registration evicts the one before.
    backend = EngineBackend(engine, limits=Limits(), model_name="tiny", skill_cache_bytes=4096)
    try:
        service = SessionService(backend, SessionStore(backend))
        for i in range(20):
            run(service.create_skill(A, SkillCreate(skill=f"k{i}", tokens=[5, 6, 7 + i])))
        held = {s.skill for s in run(service.list_skills(A)).skills}
        assert len(held) < 20  # the store did evict
        assert {key[1] for key in backend._labels} == held
    finally:
        backend.shutdown()
