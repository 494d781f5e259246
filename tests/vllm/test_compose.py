"""COMPOSE on ``VllmBackend`` through the session core, over the stand-in engine
(``_fake_engine``): a skill is one prefill in its tenant's namespace carrying a hold order;
a compose is a private build whose block past its seam is loaded from the hold, and every
row of the result equals (as a symbolic value) protocol 3.4's definition; skills are per
tenant, evicted LRU when idle, released on delete, and never read by a session afterwards."""

from __future__ import annotations

from typing import Any

import pytest

from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT
from leyline.core.turns import SamplingParams, Turn
from leyline.protocol import ErrorCode, LeylineError, Verb
from leyline.protocol.resources import ApplyDirectives, SessionCreate, SkillCreate
from leyline.vllm.backend import VllmSession

from ._fake_engine import FakeEngine, Value, computed_value, rotated_value
from ._service import Stack, handle_of, one_token_turn, run, stack

BLOCK = 4
TOKENS = list(range(100, 122))  # 22 tokens: 5 full blocks and a partial one
SKILL = [500, 501, 502, 503, 504, 505, 506]
ANCHOR = [600, 601, 602]


def _stack(secret: bytes | None = None, hold_blocks: int = 1000) -> Stack:
    return stack(FakeEngine(BLOCK, hold_blocks=hold_blocks), tenant_secret=secret)


def _register(
    service: SessionService[VllmSession],
    skill: str,
    tokens: list[int],
    anchor: list[int] | None = None,
    tenant: str = DEFAULT_TENANT,
) -> Any:
    body = SkillCreate(skill=skill, tokens=tokens, anchor={"tokens": anchor} if anchor else None)
    return run(service.create_skill(tenant, body))


def _compose(
    service: SessionService[VllmSession],
    skill: str,
    at: int,
    seam: int,
    tenant: str = DEFAULT_TENANT,
    extra: tuple[dict[str, Any], ...] = (),
) -> tuple[str, Any]:
    session = str(run(service.create(tenant, SessionCreate(tokens=TOKENS))).session)
    directive = {"verb": "compose", "skill": skill, "at": at, "seam_tokens": seam}
    body = ApplyDirectives(base_revision=1, directives=[directive, *extra])
    return session, run(service.apply(tenant, session, body))


def _chain(tokens: list[int]) -> list[Value]:
    """A prefill's rows from position 0: each computed over the ones before it."""
    values: list[Value] = []
    for p, token in enumerate(tokens):
        values.append(computed_value(token, p, values))
    return values


def _definition(at: int, seam: int, anchor: list[int]) -> list[Value]:
    """Protocol 3.4: the prefix as it was; the seam computed in context; the block's rest
    the skill's rows (computed after its anchor) rotated by ``at - len(anchor)``; the
    downstream rows rotated by the block's length; the last row computed in context."""
    old, skill = _chain(TOKENS), _chain(anchor + SKILL)
    new = TOKENS[:at] + SKILL + TOKENS[at:]
    rows: list[Value] = list(old[:at])
    for p in range(at, len(new) - 1):
        i = p - at
        if i < seam:
            rows.append(computed_value(new[p], p, rows))
        elif i < len(SKILL):
            rows.append(rotated_value(skill[len(anchor) + i], at - len(anchor)))
        else:
            rows.append(rotated_value(old[p - len(SKILL)], len(SKILL)))
    rows.append(computed_value(new[-1], len(new) - 1, rows))
    return rows


def test_compose_is_offered_with_anchors() -> None:
    _, backend, _ = _stack()
    caps = backend.capabilities()
    assert Verb.compose in caps.verbs and caps.skill_anchors


@pytest.mark.parametrize(("at", "seam", "anchor"), [(9, 2, []), (9, 2, ANCHOR), (20, 0, [])])
def test_a_compose_builds_its_definition_privately(at: int, seam: int, anchor: list[int]) -> None:
    service, backend, engine = _stack()
    info = _register(service, "rules", SKILL, anchor)
    registration = engine.requests[-1]
    assert registration.tokens == tuple(anchor + SKILL) and registration.salt is None
    hold = registration.order.hold if registration.order else None
    assert hold is not None and hold.rows == len(anchor) + len(SKILL)
    assert info.anchor_tokens == len(anchor)

    session, reply = _compose(service, "rules", at, seam)
    new = TOKENS[:at] + SKILL + TOKENS[at:]
    handle = handle_of(service, session)
    assert handle.view.tokens == tuple(new)
    assert reply.path == "splice" and reply.fallback_reason is None
    assert [(c.start, c.end) for c in reply.composed] == [(at, at + len(SKILL))]
    # Computed: the seam and the last token (protocol 3.1); the rest loaded.
    assert reply.prefilled_tokens == seam + 1
    moved = len(SKILL) - seam if at != len(anchor) else 0
    assert reply.rotated_tokens == moved + len(TOKENS) - at - 1
    built = engine.requests[-1]
    assert built.salt == handle.private_salt and built.salt is not None
    assert built.values[: len(new)] == _definition(at, seam, anchor)
    held = [kv for kv in built.kv if kv.startswith("held")]
    assert len(held) == len(SKILL) - seam
    assert held[0] == f"held {hold.key} {len(anchor) + seam} {at - len(anchor)}"

    # The turn reads the build (its recipe names the private copy, never the hold), and
    # deleting the skill changes nothing for the session.
    run(service.delete_skill(DEFAULT_TENANT, "rules"))
    assert engine.requests[-1].order is not None
    assert engine.requests[-1].order.release == (hold.key,) and not engine.holds
    outcome = one_token_turn(backend, handle, tuple(new))
    turn = engine.requests[-1]
    assert outcome.prefill.fallback_reason is None
    assert turn.values[: len(new) - 1] == _definition(at, seam, anchor)[:-1]
    assert all(not kv.startswith("held") for kv in turn.kv)


def test_a_compose_turn_does_not_leave_its_skill_to_the_turn() -> None:
    """A turn extending the composed sequence: the build's last request reads the skill,
    so it runs before the turn (a recipe must not name the hold)."""
    service, backend, engine = _stack()
    _register(service, "rules", SKILL)
    session = str(run(service.create(DEFAULT_TENANT, SessionCreate(tokens=TOKENS))).session)
    record = service.store.get(DEFAULT_TENANT, session)
    backend._rows_written = True  # a worker that has loaded rows: turns may defer
    directive = {"verb": "compose", "skill": "rules", "at": 9, "seam_tokens": 2}
    batch = ApplyDirectives(base_revision=1, directives=[directive]).directives
    plan = run(service.plan(record, batch, 1))
    new = tuple(TOKENS[:9] + SKILL + TOKENS[9:])
    turn: Turn[VllmSession] = Turn(
        record.handle,
        plan,
        (*new, 1, 2),
        None,
        SamplingParams(max_new_tokens=1),
        lambda t: True,
        lambda: False,
    )
    before = len(engine.requests)
    outcome = run(backend.run_turn(turn))
    assert outcome.edit.fallback_reason is None
    built, ran = engine.requests[before:][-2:]
    assert built.tokens[: len(new)] == new and any(kv.startswith("held") for kv in built.kv)
    assert not any(kv.startswith("held") for kv in ran.kv)
    assert record.handle.recipe is None or all(
        source.hold is None for source in record.handle.recipe.load
    )


def test_skills_are_per_tenant_and_in_the_tenants_namespace() -> None:
    service, backend, engine = _stack(secret=b"s" * 32)
    _register(service, "rules", SKILL, tenant="alpha")
    assert engine.requests[-1].salt == backend.namespace_of("alpha")
    assert [s.skill for s in backend.list_skills("alpha")] == ["rules"]
    assert backend.list_skills("bravo") == []
    with pytest.raises(LeylineError) as refused:
        _compose(service, "rules", 9, 2, tenant="bravo")
    assert refused.value.code is ErrorCode.unknown_skill
    _, reply = _compose(service, "rules", 9, 2, tenant="alpha")
    assert reply.path == "splice"


def test_a_deleted_skill_is_gone_and_one_in_use_is_kept() -> None:
    service, backend, engine = _stack()
    _register(service, "rules", SKILL)
    with backend.skills.using(DEFAULT_TENANT, ["rules"]):
        with pytest.raises(LeylineError) as busy:
            run(service.delete_skill(DEFAULT_TENANT, "rules"))
        assert busy.value.code is ErrorCode.invalid_directive
    run(service.delete_skill(DEFAULT_TENANT, "rules"))
    with pytest.raises(LeylineError) as gone:
        _compose(service, "rules", 9, 2)
    assert gone.value.code is ErrorCode.unknown_skill
    assert engine.holds == {}


def test_idle_skills_are_evicted_lru_and_a_skill_too_big_changes_nothing() -> None:
    service, backend, engine = _stack(hold_blocks=2)
    _register(service, "a", [1, 2, 3, 4])
    _register(service, "b", [5, 6, 7, 8])
    backend.skill_info(DEFAULT_TENANT, "a", False)  # a use: "b" is now the oldest
    _register(service, "c", [9, 10, 11])
    assert sorted(s.skill for s in backend.list_skills(DEFAULT_TENANT)) == ["a", "c"]
    assert len(engine.holds) == 2
    with pytest.raises(LeylineError) as big:
        _register(service, "big", list(range(20, 29)))
    assert big.value.code is ErrorCode.limit_exceeded
    assert sorted(s.skill for s in backend.list_skills(DEFAULT_TENANT)) == ["a", "c"]
    # The same content again computes nothing; other content replaces the hold.
    before = len(engine.requests)
    _register(service, "a", [1, 2, 3, 4])
    assert len(engine.requests) == before
    old_key = backend.skills.get(DEFAULT_TENANT, "a").key
    _register(service, "a", [1, 2, 3, 5])
    assert old_key not in engine.holds and len(engine.holds) == 2


def test_a_compose_before_a_forget_says_it_was_re_prefilled() -> None:
    service, _, _ = _stack()
    _register(service, "rules", SKILL)
    forget = {"verb": "forget", "span": {"start": 12, "end": 14}, "replacement": []}
    _, reply = _compose(service, "rules", 9, 2, extra=(forget,))
    assert reply.path == "reprefill" and reply.fallback_reason == "unsupported_runtime"
    later = {"verb": "forget", "span": {"start": 2, "end": 4}, "replacement": []}
    _, reply = _compose(service, "rules", 9, 2, extra=(later,))
    assert reply.path == "reprefill" and reply.fallback_reason is None
