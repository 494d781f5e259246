"""The SGLang backend's skills (``sglang.skill_store``) over a scripted scheduler.

What the store decides on its own: a registration prefills the skill and holds it; the
same content again computes nothing; past the scheduler's share for held skills the least
recently used skill no compose reads is evicted (released), and a registration is refused
with ``limit_exceeded`` when none is left; a skill a compose reads is neither deleted nor
replaced. The real hold (a lock in SGLang's tree) is tested in ``tests/sglang``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from leyline.core.backend import SkillLabel, SkillRegistration
from leyline.protocol import ErrorCode, LeylineError
from leyline.sglang.skill_store import SkillHolds

from .scripted_scheduler import ScriptedScheduler

T = "tenant"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _skill(
    tenant: str, skill_id: str, tokens: Iterable[int], label: SkillLabel, anchor: Sequence[int] = ()
) -> SkillRegistration:
    return SkillRegistration(tenant, skill_id, tuple(tokens), tuple(anchor), label)


def _store(hold_cap: int = 100) -> tuple[SkillHolds, ScriptedScheduler]:
    scheduler = ScriptedScheduler(hold_cap=hold_cap)
    return SkillHolds(scheduler, "m"), scheduler


def test_register_prefills_then_holds_and_the_same_content_computes_nothing() -> None:
    store, scheduler = _store()
    skill = run(store.register(_skill(T, "a", range(10, 40), SkillLabel(name="rules"))))
    assert (skill.held, scheduler.prefills, scheduler.sent) == (30, [30], ["hold"])
    again = run(store.register(_skill(T, "a", range(10, 40), SkillLabel(name="renamed"))))
    assert again is skill and again.label.name == "renamed"
    assert (scheduler.prefills, scheduler.sent) == ([30], ["hold"])
    anchored = run(store.register(_skill(T, "b", range(10, 40), SkillLabel(), anchor=[1, 2])))
    assert anchored.source == (1, 2, *range(10, 40)) and anchored.held == 32
    assert anchored.content_hash != skill.content_hash


def test_past_the_hold_share_the_least_recently_used_idle_skill_is_evicted() -> None:
    store, scheduler = _store(hold_cap=100)
    run(store.register(_skill(T, "old", range(0, 40), SkillLabel())))
    run(store.register(_skill(T, "used", range(100, 140), SkillLabel())))
    store.get(T, "old")  # a use: "used" is now the least recent
    run(store.register(_skill(T, "new", range(200, 240), SkillLabel())))
    assert [s.id for s in store.of_tenant(T)] == ["old", "new"]
    assert scheduler.sent[-1] == "hold"  # one request: it released "used" to make room
    assert set(scheduler.held) == {store.get(T, "old").hold_key, store.get(T, "new").hold_key}
    with pytest.raises(LeylineError) as info:
        store.get(T, "used")
    assert info.value.code is ErrorCode.unknown_skill


def test_a_registration_that_cannot_fit_evicts_nothing() -> None:
    """Refused with ``limit_exceeded`` only after finding that even every idle skill
    evicted leaves no room: nothing was evicted (a rejected request changes nothing)."""
    store, scheduler = _store(hold_cap=100)
    run(store.register(_skill(T, "a", range(0, 40), SkillLabel())))
    run(store.register(_skill(T, "b", range(100, 140), SkillLabel())))
    with pytest.raises(LeylineError) as info:
        run(store.register(_skill(T, "huge", range(200, 320), SkillLabel())))
    assert info.value.code is ErrorCode.limit_exceeded
    assert [s.id for s in store.of_tenant(T)] == ["a", "b"]
    assert len(scheduler.held) == 2


def test_a_skill_a_compose_reads_is_never_evicted_deleted_or_replaced() -> None:
    store, scheduler = _store(hold_cap=60)
    run(store.register(_skill(T, "a", range(0, 40), SkillLabel())))
    with store.using(T, ["a"]):
        with pytest.raises(LeylineError) as full:
            run(store.register(_skill(T, "b", range(100, 140), SkillLabel())))
        assert full.value.code is ErrorCode.limit_exceeded
        for action in (
            lambda: run(store.delete(T, "a")),
            lambda: run(store.register(_skill(T, "a", range(50, 60), SkillLabel()))),
        ):
            with pytest.raises(LeylineError) as busy:
                action()
            assert (busy.value.code, busy.value.field) == (ErrorCode.invalid_directive, "skill")
        assert store.get(T, "a").tokens == tuple(range(0, 40))
    run(store.delete(T, "a"))
    assert scheduler.held == {} and store.of_tenant(T) == []


def test_tenants_do_not_see_each_others_skills() -> None:
    store, _ = _store()
    run(store.register(_skill(T, "a", range(0, 10), SkillLabel())))
    assert store.tokens_of("other")("a") is None
    assert store.tokens_of(T)("a") == tuple(range(10))
    with pytest.raises(LeylineError) as info:
        run(store.delete("other", "a"))
    assert info.value.code is ErrorCode.unknown_skill
