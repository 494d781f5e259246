"""Resolving directives (anchors, text, limits, verbs) into edits."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from leyline.protocol import (
    ErrorCode,
    LeylineError,
    Limits,
    MessageSpan,
    Mode,
    TokenSpan,
    Verb,
    parse_directives,
    resolve_batch,
)


def tokenize(text: str) -> Sequence[int]:
    """A deterministic stand-in tokenizer, one token per character: the rules are tokenizer-free."""
    return [ord(c) for c in text]


SPANS = [
    MessageSpan(message=0, role="system", start=0, end=10, content=TokenSpan(start=3, end=9)),
    MessageSpan(message=1, role="tool", start=10, end=40, content=TokenSpan(start=13, end=39)),
]


def resolve(data: list[dict[str, object]], **kwargs: object):  # type: ignore[no-untyped-def]
    return resolve_batch(
        parse_directives(data), length=40, tokenize=tokenize, spans=SPANS, **kwargs
    )  # type: ignore[arg-type]


def test_message_anchor_resolves_to_the_rendered_span() -> None:
    batch = resolve(
        [{"verb": "splice", "span": {"message": 1, "part": "content"}, "replacement": "[evicted]"}]
    )
    (edit,) = batch.edits
    assert (edit.start, edit.end, edit.mode) == (13, 39, Mode.amortize)
    assert edit.replacement == tuple(tokenize("[evicted]"))


def test_token_ids_are_used_as_given_and_forget_keeps_its_mode() -> None:
    (edit,) = resolve(
        [{"verb": "forget", "span": {"start": 2, "end": 5}, "replacement": [7]}]
    ).edits
    assert (edit.start, edit.end, edit.replacement, edit.mode) == (2, 5, (7,), Mode.forget)


def test_erratum_appends_at_the_end() -> None:
    (edit,) = resolve([{"verb": "erratum", "text": "fix", "corrects": {"message": 1}}]).edits
    assert (edit.start, edit.end, edit.replacement) == (40, 40, tuple(tokenize("fix")))


def test_marks_carry_non_editing_verbs_when_supported() -> None:
    batch = resolve(
        [
            {"verb": "pin", "span": {"message": 0}, "ttl_s": 5},
            {"verb": "decay", "span": {"start": 12, "end": 20}, "priority": 3, "replacement": "x"},
        ],
        supported=set(Verb),
    )
    pin, decay = batch.marks
    assert batch.edits == ()
    assert (pin.verb, pin.start, pin.end, pin.ttl_s) == (Verb.pin, 0, 10, 5.0)
    assert (decay.verb, decay.start, decay.end, decay.priority) == (Verb.decay, 12, 20, 3)
    assert decay.mode is Mode.forget and decay.replacement == tuple(tokenize("x"))


def test_a_mark_needs_at_least_one_token() -> None:
    with pytest.raises(LeylineError) as caught:
        resolve([{"verb": "scratch", "span": {"start": 3, "end": 3}}], supported=set(Verb))
    assert caught.value.code is ErrorCode.invalid_span


def test_compose_needs_a_known_skill() -> None:
    skills = {"s": [1, 2, 3]}
    batch = resolve(
        [{"verb": "compose", "skill": "s", "at": 10}], supported=set(Verb), skill_tokens=skills.get
    )
    assert batch.edits[0].replacement == (1, 2, 3) and batch.edits[0].start == 10
    with pytest.raises(LeylineError) as info:
        resolve(
            [{"verb": "compose", "skill": "t", "at": 10}],
            supported=set(Verb),
            skill_tokens=skills.get,
        )
    assert info.value.code is ErrorCode.unknown_skill


@pytest.mark.parametrize(
    ("data", "kwargs", "code", "field"),
    [
        (
            [{"verb": "pin", "span": {"start": 0, "end": 1}}],
            {},
            ErrorCode.unsupported_verb,
            "directives[0].verb",
        ),
        (
            [{"verb": "splice", "span": {"start": 0, "end": 1}}] * 3,
            {"limits": Limits(max_directives=2)},
            ErrorCode.too_many_directives,
            "directives",
        ),
        (
            [{"verb": "splice", "span": {"start": 0, "end": 1}, "replacement": "abcdef"}],
            {"limits": Limits(max_replacement_tokens=5)},
            ErrorCode.replacement_too_long,
            "directives[0].replacement",
        ),
        (
            [{"verb": "splice", "span": {"start": 30, "end": 41}}],
            {},
            ErrorCode.invalid_span,
            "directives[0].span",
        ),
        (
            [{"verb": "splice", "span": {"message": 7}}],
            {},
            ErrorCode.unresolved_anchor,
            "directives[0].span",
        ),
        (
            [{"verb": "splice", "span": {"message": 0, "part": "tool_calls"}}],
            {},
            ErrorCode.unresolved_anchor,
            "directives[0].span",
        ),
        (
            [{"verb": "erratum", "text": "x", "corrects": {"start": 0, "end": 99}}],
            {},
            ErrorCode.invalid_span,
            "directives[0].corrects",
        ),
        (
            [{"verb": "compose", "skill": "s", "at": 41}],
            {"supported": set(Verb)},
            ErrorCode.invalid_span,
            "directives[0].at",
        ),
    ],
)
def test_resolution_errors_are_typed(
    data: list[dict[str, object]], kwargs: dict[str, object], code: ErrorCode, field: str
) -> None:
    with pytest.raises(LeylineError) as info:
        resolve(data, **kwargs)
    assert (info.value.code, info.value.field) == (code, field)


def test_unsupported_verb_is_refused_even_behind_a_valid_directive() -> None:
    with pytest.raises(LeylineError) as info:
        resolve(
            [
                {"verb": "splice", "span": {"start": 0, "end": 1}},
                {"verb": "scratch", "span": {"start": 2, "end": 3}},
            ]
        )
    assert info.value.code is ErrorCode.unsupported_verb
    assert info.value.field == "directives[1].verb"
