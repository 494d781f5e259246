"""A splice that arrives with a turn (the agent's case): the build's last request is left to
the turn, whose prompt extends the new sequence, so the turn loads the same rows and computes
the same ones in the same context. Checked over the stand-in engine (``_fake_engine``),
whose rows are symbolic values: every row of the turn, and of the turn after it, equals the
row the same splice built alone (``apply``, then a turn) gives."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import pytest

from leyline.core.sessions import DEFAULT_TENANT
from leyline.core.turns import Outcome, SamplingParams, Turn
from leyline.protocol.resources import ApplyDirectives
from leyline.vllm.backend import VllmBackend, VllmSession
from leyline.vllm.build import padded
from leyline.vllm.link import Answer
from leyline.vllm.runner import Ran

from ._fake_engine import FakeEngine, Value
from ._service import handle_of, run
from .test_backend import BLOCK, TOKENS, _session, _splice, _stack

TAIL = (90, 91, 92, 93, 94)
"""The turn's new message, after the edited sequence."""


def _turn(service: Any, session: str, directives: Sequence[dict[str, Any]], prompt: Any) -> Outcome:
    """One turn: ``directives`` planned against the session, then ``prompt`` generated."""
    record = service.store.get(DEFAULT_TENANT, session)
    plan = None
    if directives:
        revision = record.handle.view.revision
        batch = ApplyDirectives(base_revision=revision, directives=list(directives)).directives
        plan = run(service.plan(record, batch, revision))
    turn: Turn[VllmSession] = Turn(
        record.handle,
        plan,
        tuple(prompt),
        None,
        SamplingParams(max_new_tokens=1),
        lambda t: True,
        lambda: False,
    )
    outcome: Outcome = run(service.backend.run_turn(turn))
    return outcome


def _loaded_once(service: Any, backend: VllmBackend) -> None:
    """A splice built alone first: the backend has seen this worker load rows."""
    other = _session(service, TOKENS)
    body = ApplyDirectives(base_revision=1, directives=[_splice(0, 1, [5])])
    run(service.apply(DEFAULT_TENANT, other, body))


def _values(engine: FakeEngine) -> list[Value]:
    """The rows of the last request's prompt, as values."""
    request = engine.requests[-1]
    return request.values[: len(request.tokens)]


EDITS = {
    "cut": [_splice(6, 10, [])],
    "replacement": [_splice(6, 10, [1])],
    "cut and replacement": [_splice(6, 10, []), _splice(13, 15, [3, 4, 5])],
    "on block boundaries": [_splice(4, 8, [1, 2, 3, 4])],
    "appended run": [_splice(6, 10, []), _splice(22, 22, [1, 2, 3])],
    "inside the partial block": [_splice(20, 20, [9, 9])],
}


@pytest.mark.parametrize("name", list(EDITS))
def test_every_row_is_the_one_a_separate_build_gives(name: str) -> None:
    service, backend, engine = _stack()
    _loaded_once(service, backend)
    edits = EDITS[name]

    start = len(engine.requests)
    alone = _session(service, TOKENS)
    body = ApplyDirectives(base_revision=1, directives=edits)
    alone_edit = run(service.apply(DEFAULT_TENANT, alone, body))
    built_alone = len(engine.requests) - start - 1  # less the session's own prefill
    new = handle_of(service, alone).view.tokens
    alone_outcome = _turn(service, alone, [], (*new, *TAIL))
    expected = _values(engine)
    follow = (*handle_of(service, alone).view.tokens, 42)
    _turn(service, alone, [], follow)
    expected_next = _values(engine)

    merged = _session(service, TOKENS)
    before = len(engine.requests)
    outcome = _turn(service, merged, edits, (*new, *TAIL))
    assert _values(engine) == expected
    # The build's last request was the turn: one request fewer than the build and a turn.
    assert len(engine.requests) - before == built_alone
    _turn(service, merged, [], follow)
    assert _values(engine) == expected_next
    assert outcome.edit is not None and outcome.edit.fallback_reason is None
    for field in ("path", "reused_tokens", "prefilled_tokens", "rotated_tokens"):
        assert getattr(outcome.edit, field) == getattr(alone_edit, field), field
    assert outcome.prefill.reused_tokens == alone_outcome.prefill.reused_tokens


def test_the_turn_runs_the_builds_last_request() -> None:
    service, backend, engine = _stack()
    _loaded_once(service, backend)
    session = _session(service, TOKENS)
    before = len(engine.requests)
    new = (*TOKENS[:6], 1, *TOKENS[10:])  # 19 tokens
    outcome = _turn(service, session, [_splice(6, 10, [1])], (*new, *TAIL))
    # The old partial block, the inserted run's request, then the turn: no request of the
    # whole sequence padded with filler.
    old, run, turn = engine.requests[before:]
    assert old.tokens == padded(TOKENS, BLOCK) and run.tokens == padded(new[:7], BLOCK)
    salt = handle_of(service, session).private_salt
    assert turn.tokens == (*new, *TAIL) and turn.salt == salt
    assert turn.kv[:4] == ["hit"] * 4
    assert turn.kv[4:7] == [f"loaded {salt} {p} 0" for p in range(4, 7)]
    assert turn.kv[7:18] == [f"loaded None {p + 3} -3" for p in range(7, 18)]
    assert turn.kv[18:] == ["computed"] * (1 + len(TAIL))  # the new last token, the tail
    edit = outcome.edit
    assert edit is not None and edit.fallback_reason is None
    assert (edit.reused_tokens, edit.prefilled_tokens, edit.rotated_tokens) == (17, 2, 11)
    assert (outcome.prefill.reused_tokens, outcome.prefill.prefilled_tokens) == (19, 5)


REPLACED = (*TOKENS[:6], 1, *TOKENS[10:], *TAIL)
"""The prompt of a turn that replaces old rows 6-9 with one token, then adds ``TAIL``."""


def _replacement_turn(
    around: Callable[[FakeEngine, tuple[int, ...], Callable[[], Awaitable[Ran]]], Awaitable[Ran]],
) -> tuple[Outcome, FakeEngine]:
    """That turn, on a backend that has loaded rows once, with the turn's own request run
    through ``around(engine, tokens, run)`` (the build's requests run as they are)."""
    service, backend, engine = _stack()
    _loaded_once(service, backend)
    session = _session(service, TOKENS)
    run = engine.run

    class Around:
        async def run(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Ran:
            request = partial(run, tokens, *args, **kwargs)
            if tuple(tokens) != REPLACED:
                return await request()
            return await around(engine, tuple(tokens), request)

    backend.runner = Around()
    return _turn(service, session, [_splice(6, 10, [1])], REPLACED), engine


def test_a_source_evicted_before_the_turn_is_the_edits_missing_source() -> None:
    async def evicting(engine: FakeEngine, _: tuple[int, ...], run: Any) -> Ran:
        engine.cache.pop((None, padded(TOKENS, BLOCK)[:16]))  # old rows 12-15
        return await run()

    outcome, engine = _replacement_turn(evicting)
    prompt = REPLACED
    turn = engine.requests[-1]
    # Old rows 10 and 11 (new 7, 8) loaded; from old row 12 on, computed by the turn.
    assert turn.kv[7:9] == [f"loaded None {p + 3} -3" for p in range(7, 9)]
    assert turn.kv[9:] == ["computed"] * (len(prompt) - 9)
    edit = outcome.edit
    assert edit is not None and edit.fallback_reason == "missing_source"
    assert (edit.reused_tokens, edit.prefilled_tokens) == (8, 11)  # 6 + 2 of the 17 kept
    assert edit.rotated_tokens == 2
    assert outcome.prefill.fallback_reason is None  # the edit's rows, reported there


def test_the_build_runs_whole_until_a_worker_has_loaded_rows() -> None:
    """A worker that cannot write rows is found out by a build's own request, before a
    generation runs on it."""
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    new = (*TOKENS[:6], *TOKENS[10:])
    _turn(service, session, [_splice(6, 10, [])], (*new, *TAIL))
    assert engine.requests[-2].tokens == padded(new, BLOCK)  # the build's last request
    _turn(service, session, [_splice(0, 2, [])], (*new[2:], *TAIL))
    assert padded(new[2:], BLOCK) not in [r.tokens for r in engine.requests[-3:]]


def test_a_prompt_that_does_not_extend_the_edit_gets_the_whole_build() -> None:
    service, backend, engine = _stack()
    _loaded_once(service, backend)
    session = _session(service, TOKENS)
    new = (*TOKENS[:6], *TOKENS[10:])
    other = (*new[:-1], 77, *TAIL)  # diverges at the new sequence's last token
    outcome = _turn(service, session, [_splice(6, 10, [])], other)
    assert engine.requests[-2].tokens == padded(new, BLOCK)
    assert outcome.edit is not None and outcome.edit.fallback_reason is None


def test_a_turn_whose_rows_the_worker_refused_says_it_re_prefilled() -> None:
    async def refusing(engine: FakeEngine, _: tuple[int, ...], run: Any) -> Ran:
        return replace(await run(), answer=Answer(fallback_reason="unsupported_layout"))

    outcome, _ = _replacement_turn(refusing)
    edit = outcome.edit
    assert edit is not None and edit.path == "reprefill"
    assert edit.fallback_reason == "unsupported_layout" and edit.rotated_tokens == 0
    assert (edit.reused_tokens, edit.prefilled_tokens) == (6, 13)
