"""Every verb round-trips through JSON; every malformed directive gets a typed error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from leyline.protocol import (
    ErratumDirective,
    ErrorCode,
    ForgetDirective,
    LeylineError,
    LeylineRequest,
    Mode,
    SpliceDirective,
    TokenSpan,
    from_tuple,
    parse_directives,
    parse_model,
    to_tuple,
)
from leyline.protocol.directives import DIRECTIVE_ADAPTER

EXAMPLES: list[dict[str, Any]] = [
    {"verb": "splice", "span": {"start": 3, "end": 9}, "replacement": "[evicted]"},
    {"verb": "splice", "span": {"message": 4, "part": "content"}, "replacement": [1, 2]},
    {"verb": "forget", "span": {"start": 0, "end": 1}, "replacement": ""},
    {"verb": "erratum", "text": "[STATE UPDATE] status -> shipped", "corrects": None},
    {"verb": "compose", "skill": "sql-style-guide", "at": 12, "seam_tokens": 2},
    {"verb": "pin", "span": {"message": 0, "part": "all"}},
    {"verb": "decay", "span": {"start": 5, "end": 7}},
    {"verb": "scratch", "span": {"start": 5, "end": 7}, "mode": "amortize"},
]


@pytest.mark.parametrize("data", EXAMPLES, ids=lambda d: str(d["verb"]))
def test_every_verb_round_trips_through_json(data: dict[str, Any]) -> None:
    directive = DIRECTIVE_ADAPTER.validate_python(data)
    assert directive.verb == data["verb"]
    wire = DIRECTIVE_ADAPTER.dump_json(directive)
    assert DIRECTIVE_ADAPTER.validate_json(wire) == directive
    assert json.loads(wire) == DIRECTIVE_ADAPTER.dump_python(directive, mode="json")


def test_paper_tuple_maps_onto_splice_and_forget_exactly() -> None:
    splice = from_tuple(3, 9, "stub", Mode.amortize)
    forget = from_tuple(3, 9, [5], "forget")
    assert isinstance(splice, SpliceDirective) and isinstance(forget, ForgetDirective)
    assert to_tuple(splice) == (3, 9, "stub", Mode.amortize)
    assert to_tuple(forget) == (3, 9, [5], Mode.forget)


def test_anchored_directive_has_no_tuple_until_resolved() -> None:
    directive = parse_directives([{"verb": "splice", "span": {"message": 2}}])[0]
    assert isinstance(directive, SpliceDirective)
    with pytest.raises(ValueError, match="message-anchored"):
        to_tuple(directive)


def test_erratum_for_field_renders_the_canonical_note() -> None:
    note = ErratumDirective.for_field("order_status", "refunded", TokenSpan(start=4, end=6))
    assert "[STATE UPDATE] order_status -> refunded; overrides the earlier value." in str(note.text)


@pytest.mark.parametrize(
    ("data", "code", "field"),
    [
        (
            {"verb": "splize", "span": {"start": 0, "end": 1}},
            ErrorCode.invalid_directive,
            "directives[0]",
        ),
        ({"span": {"start": 0, "end": 1}}, ErrorCode.invalid_directive, "directives[0]"),
        (
            {"verb": "splice", "span": {"start": 5, "end": 2}},
            ErrorCode.invalid_span,
            "directives[0].span",
        ),
        (
            {"verb": "splice", "span": {"start": -1, "end": 2}},
            ErrorCode.invalid_span,
            "directives[0].span.start",
        ),
        (
            {"verb": "forget", "span": {"message": -2}},
            ErrorCode.invalid_span,
            "directives[0].span.message",
        ),
        (
            {"verb": "splice", "span": {"start": 0, "end": 1}, "mode": "forget"},
            ErrorCode.invalid_directive,
            "directives[0].mode",
        ),
        (
            {"verb": "splice", "span": {"start": 0, "end": 1, "len": 1}},
            ErrorCode.invalid_directive,
            "directives[0].span.len",
        ),
        (
            {"verb": "splice", "span": {"start": "a", "end": 1}},
            ErrorCode.invalid_directive,
            "directives[0].span.start",
        ),
        (
            {"verb": "splice", "span": {"start": 0, "end": 1}, "replacement": [1, -4]},
            ErrorCode.invalid_directive,
            "directives[0].replacement[1]",
        ),
        ({"verb": "splice"}, ErrorCode.invalid_directive, "directives[0].span"),
        ({"verb": "erratum", "text": ""}, ErrorCode.invalid_directive, "directives[0].text"),
        ({"verb": "compose", "skill": "s", "at": -3}, ErrorCode.invalid_span, "directives[0].at"),
        (
            {"verb": "scratch", "span": {"start": 0, "end": 1}, "mode": "later"},
            ErrorCode.invalid_directive,
            "directives[0].mode",
        ),
    ],
)
def test_malformed_directives_name_the_field_and_rule(
    data: dict[str, Any], code: ErrorCode, field: str
) -> None:
    with pytest.raises(LeylineError) as info:
        parse_directives([data])
    assert info.value.code is code, info.value
    assert info.value.field == field, info.value
    assert info.value.message


def test_a_batch_that_is_not_a_list_is_rejected() -> None:
    with pytest.raises(LeylineError) as info:
        parse_directives({"verb": "splice"})
    assert info.value.code is ErrorCode.invalid_directive
    assert info.value.field == "directives"


def test_request_extension_forbids_extra_fields_and_checks_types() -> None:
    with pytest.raises(LeylineError) as info:
        parse_model(LeylineRequest, {"session": "s", "directives": [], "revison": 3}, "leyline")
    assert info.value.field == "leyline.revison"
    with pytest.raises(LeylineError) as info:
        parse_model(LeylineRequest, {"session": "", "directives": []}, "leyline")
    assert info.value.field == "leyline.session"
    ok = parse_model(LeylineRequest, {"session": "s", "base_revision": 2, "directives": EXAMPLES})
    assert len(ok.directives) == len(EXAMPLES)


def test_error_round_trips_through_its_wire_body() -> None:
    error = LeylineError(
        ErrorCode.revision_conflict,
        "base revision 3 is stale; current is 4",
        "leyline.base_revision",
    )
    body = error.to_body()
    assert body.model_dump(mode="json")["error"]["code"] == "revision_conflict"
    again = LeylineError.from_body(body)
    assert (again.code, again.message, again.field, again.http_status) == (
        error.code,
        error.message,
        error.field,
        409,
    )
