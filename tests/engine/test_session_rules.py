"""Rejected or failed batches leave a session bitwise unchanged; typed errors and fallbacks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.engine import Engine
from leyline.engine.forward import Forwards
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.capabilities import Limits
from leyline.protocol.directives import (
    ComposeDirective,
    DecayDirective,
    ErratumDirective,
    ForgetDirective,
    Mode,
    PinDirective,
    ScratchDirective,
    SpliceDirective,
)
from leyline.protocol.envelope import Path
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.fallback import FallbackReason
from leyline.protocol.spans import MessageAnchor, MessageSpan, TokenSpan

from ._helpers import kv_bitwise_equal, random_tokens, rel_err, snapshot, tiny_llama

N = 40
SPANS = (
    MessageSpan(message=0, role="system", start=0, end=12, content=TokenSpan(start=3, end=11)),
    MessageSpan(message=1, role="user", start=12, end=40, content=TokenSpan(start=15, end=39)),
)


@pytest.fixture()
def session(llama_engine: Engine) -> SessionCache:
    s = SessionCache(llama_engine)
    s.prefill(random_tokens(N, llama_engine.vocab_size, seed=1), spans=SPANS)
    return s


def _unchanged_after(session: SessionCache, action: Callable[[], object]) -> BaseException:
    state, kv = session.state, snapshot(session.kv)
    tokens, revision = session.tokens, session.revision
    with pytest.raises((LeylineError, SpliceUnsupportedError, RuntimeError)) as info:
        action()
    assert session.state is state
    assert session.tokens == tokens and session.revision == revision
    assert kv_bitwise_equal(session.kv, kv)
    return info.value


def _code(session: SessionCache, action: Callable[[], object]) -> ErrorCode:
    err = _unchanged_after(session, action)
    assert isinstance(err, LeylineError)
    return err.code


def test_rejections_are_typed_and_change_nothing(session: SessionCache) -> None:
    rev = session.revision
    amortize = Mode.amortize
    cases = {
        ErrorCode.revision_conflict: lambda: session.apply_edits(
            [Edit(1, 2, (), amortize)], base_revision=rev + 1
        ),
        ErrorCode.overlapping_directives: lambda: session.apply_edits(
            [Edit(1, 5, (), amortize), Edit(4, 6, (3,), amortize)]
        ),
        ErrorCode.invalid_span: lambda: session.apply_edits([Edit(30, N + 1, (), amortize)]),
        ErrorCode.invalid_directive: lambda: session.apply_edits([Edit(1, 2, (10**6,), amortize)]),
        ErrorCode.too_many_directives: lambda: session.apply_edits(
            [Edit(i, i + 1, (), amortize, i) for i in range(0, 2 * 65, 2)][:65]
        ),
        ErrorCode.replacement_too_long: lambda: session.apply_edits(
            [Edit(1, 2, (5,) * 5000, amortize)]
        ),
        ErrorCode.session_too_long: lambda: session.apply_edits(
            [Edit(N, N, (5,) * 4000, amortize)] * 1
        ),
    }
    for code, action in cases.items():
        assert _code(session, action) is code


@pytest.mark.parametrize(
    "directive",
    [
        ComposeDirective(skill="s", at=0),
        PinDirective(span=TokenSpan(start=0, end=3)),
        DecayDirective(span=TokenSpan(start=0, end=3)),
        ScratchDirective(span=TokenSpan(start=0, end=3)),
    ],
)
def test_unimplemented_verbs_answer_unsupported_verb(session: SessionCache, directive) -> None:
    batch = [SpliceDirective(span=TokenSpan(start=0, end=2), replacement=[4]), directive]
    assert _code(session, lambda: session.apply_directives(batch)) is ErrorCode.unsupported_verb


def test_a_failure_midway_leaves_the_session_unchanged(
    session: SessionCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(Forwards, "into", broken)
    monkeypatch.setattr(session.engine, "edits_in_place", False)  # the copy path's loop
    err = _unchanged_after(
        session,
        lambda: session.apply_edits(
            [Edit(30, 35, (), Mode.amortize), Edit(5, 9, (1, 2, 3), Mode.amortize)]
        ),
    )
    assert "out of memory" in str(err)


def test_message_anchors_resolve_and_spans_follow_the_edit(session: SessionCache) -> None:
    report = session.apply_directives(
        [ForgetDirective(span=MessageAnchor(message=1, part="content"), replacement=[9, 9])],
        base_revision=session.revision,
    )
    assert report.path is Path.reprefill
    assert session.tokens[15:17] == (9, 9) and len(session.tokens) == N - 24 + 2
    user = session.spans[1]
    assert (user.start, user.end, user.content) == (12, 18, TokenSpan(start=15, end=17))
    bad = [SpliceDirective(span=MessageAnchor(message=5), replacement=[1])]
    assert _code(session, lambda: session.apply_directives(bad)) is ErrorCode.unresolved_anchor


def test_text_needs_a_tokenizer(session: SessionCache) -> None:
    batch = [ErratumDirective(text="note")]
    assert _code(session, lambda: session.apply_directives(batch)) is ErrorCode.invalid_directive


def test_plain_string_modes_are_honoured(session: SessionCache) -> None:
    report = session.apply_edits([Edit(5, 10, (), "forget")])  # type: ignore[arg-type]
    assert report.path is Path.reprefill and report.rotated_tokens == 0


def test_unshiftable_rope_falls_back_to_reprefill_with_a_reason() -> None:
    engine = Engine(tiny_llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    assert engine.splice_refusal is not None
    tokens = random_tokens(N, engine.vocab_size, seed=2)
    session = SessionCache(engine)
    session.prefill(tokens)
    strict = lambda: session.apply_edits([Edit(5, 10, (), Mode.amortize)], allow_fallback=False)  # noqa: E731
    err = _unchanged_after(session, strict)
    assert isinstance(err, SpliceUnsupportedError)
    assert err.reason is FallbackReason.unsupported_rope
    report = session.apply_edits([Edit(5, 10, (), Mode.amortize)])
    assert report.path is Path.reprefill
    assert report.fallback_reason is FallbackReason.unsupported_rope
    assert (report.reused_tokens, report.prefilled_tokens) == (5, N - 10)
    fresh = engine.forward((), tokens[:5] + tokens[10:])[1]
    assert rel_err(session.next_token_logits(), fresh) <= 1e-5


def test_limits_come_from_the_engine() -> None:
    engine = Engine(tiny_llama(), limits=Limits(max_directives=1))
    session = SessionCache(engine)
    session.prefill(random_tokens(10, engine.vocab_size, seed=3))
    edits = [Edit(1, 2, (), Mode.amortize), Edit(4, 5, (), Mode.amortize, 1)]
    assert _code(session, lambda: session.apply_edits(edits)) is ErrorCode.too_many_directives
