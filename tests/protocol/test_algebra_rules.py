"""Specific rules of the edit algebra, each with the error it must raise."""

from __future__ import annotations

import pytest

from leyline.protocol import Edit, ErrorCode, LeylineError, Mode, apply_edits

BASE = list(range(100, 120))


def test_splice_shifts_downstream_and_counts_tokens() -> None:
    result = apply_edits(BASE, [Edit(5, 15, (1, 2), Mode.amortize)])
    assert result.tokens == (*BASE[:5], 1, 2, *BASE[15:])
    assert [(r.kind, r.new_start, r.new_end, r.delta) for r in result.runs] == [
        ("kept", 0, 5, 0),
        ("inserted", 5, 7, 0),
        ("kept", 7, 12, -8),
    ]
    assert (result.reused_tokens, result.prefilled_tokens, result.rotated_tokens) == (10, 2, 5)
    assert result.first_change == 5


def test_forget_recomputes_everything_after_its_start() -> None:
    result = apply_edits(BASE, [Edit(3, 4, (), Mode.amortize), Edit(10, 12, (), Mode.forget)])
    kinds = [(r.kind, r.new_start, r.new_end) for r in result.runs]
    assert kinds == [
        (
            "kept",
            0,
            3,
        ),
        ("kept", 3, 9),
        ("recompute", 9, 17),
    ]
    assert result.rotated_tokens == 6 and result.prefilled_tokens == 8


def test_erratum_style_append_keeps_the_whole_prefix() -> None:
    result = apply_edits(BASE, [Edit(20, 20, (7, 8, 9))])
    assert result.tokens == (*BASE, 7, 8, 9)
    assert result.reused_tokens == 20 and result.rotated_tokens == 0
    assert result.first_change == 20


def test_insertions_at_one_position_apply_in_batch_order_before_a_span_there() -> None:
    edits = [Edit(4, 6, (50,), index=0), Edit(4, 4, (1,), index=1), Edit(4, 4, (2,), index=2)]
    assert apply_edits(BASE, edits).tokens[3:8] == (103, 1, 2, 50, 106)


def test_touching_spans_are_allowed() -> None:
    result = apply_edits(BASE, [Edit(2, 4, (), index=0), Edit(4, 6, (9,), index=1)])
    assert result.tokens[:4] == (100, 101, 9, 106)


def test_common_leading_tokens_are_kept_not_recomputed() -> None:
    result = apply_edits(BASE, [Edit(5, 8, (105, 106, 1))])
    assert result.first_change == 7
    assert result.prefilled_tokens == 1


@pytest.mark.parametrize(
    ("edits", "code", "field"),
    [
        ([Edit(5, 21)], ErrorCode.invalid_span, "directives[0]"),
        ([Edit(-1, 2)], ErrorCode.invalid_span, "directives[0]"),
        ([Edit(6, 5, (1,))], ErrorCode.invalid_span, "directives[0]"),
        ([Edit(3, 3, (), index=4)], ErrorCode.invalid_span, "directives[4]"),
        (
            [Edit(2, 6, index=0), Edit(5, 8, index=1)],
            ErrorCode.overlapping_directives,
            "directives[1]",
        ),
        (
            [Edit(2, 6, index=0), Edit(4, 4, (1,), index=1)],
            ErrorCode.overlapping_directives,
            "directives[1]",
        ),
        (
            [Edit(2, 10, index=0), Edit(3, 4, index=1), Edit(12, 13, index=2)],
            ErrorCode.overlapping_directives,
            "directives[1]",
        ),
        (
            [Edit(2, 4, index=0), Edit(2, 4, (1,), index=1)],
            ErrorCode.overlapping_directives,
            "directives[1]",
        ),
    ],
)
def test_bad_batches_raise_typed_errors_and_leave_the_base_alone(
    edits: list[Edit], code: ErrorCode, field: str
) -> None:
    base = list(BASE)
    with pytest.raises(LeylineError) as info:
        apply_edits(base, edits)
    assert info.value.code is code
    assert info.value.field == field
    assert base == BASE


def test_overlap_error_names_both_directives() -> None:
    with pytest.raises(LeylineError, match=r"directives 0 \[2, 10\) and 1 \[3, 4\) overlap"):
        apply_edits(BASE, [Edit(2, 10, index=0), Edit(3, 4, index=1)])


def test_position_map_rejects_positions_outside_the_base() -> None:
    result = apply_edits(BASE, [Edit(1, 2)])
    with pytest.raises(IndexError):
        result.position_map.new_position(20)


def test_a_mode_given_as_a_plain_string_is_honoured() -> None:
    result = apply_edits(BASE, [Edit(3, 4, (), "forget")])  # type: ignore[arg-type]
    assert [r.kind for r in result.runs] == ["kept", "recompute"]
