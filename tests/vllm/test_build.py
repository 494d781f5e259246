"""The requests a private build runs (``build.plan_build``): every request ends on a block
boundary (filler after the sequence's tokens), every kept row is loaded, and only the
inserted runs and the new last token are computed."""

from __future__ import annotations

from leyline.protocol.algebra import Edit, apply_edits
from leyline.vllm.build import (
    Build,
    old_rows_needed,
    padded,
    plan_build,
    recipe_of,
    recipe_within,
)
from leyline.vllm.link import LoadSource, Order, RowRun

OLD = tuple(range(100, 122))  # 22 tokens: 5 whole blocks of 4 and a partial one
P = "leyline-session-p"


def _build(edits: list[Edit], computed: int = len(OLD)) -> tuple[Build, tuple[int, ...]]:
    result = apply_edits(OLD, edits)
    old = (None, padded(OLD[:computed], 4))
    build = plan_build(old, computed, result.tokens, result.position_map, P, 4)
    return build, tuple(result.tokens)


def test_padded_fills_the_last_block_with_the_last_token() -> None:
    assert padded((1, 2, 3, 4, 5), 4) == (1, 2, 3, 4, 5, 5, 5, 5)
    assert padded((1, 2, 3, 4), 4) == (1, 2, 3, 4)


def test_a_cut_loads_every_kept_row_and_computes_only_the_last_token() -> None:
    build, new = _build([Edit(6, 10, ())])
    (whole,) = build.requests
    assert whole.tokens == padded(new, 4) and whole.length == len(new) == 18
    old = padded(OLD, 4)
    # The prefix as it is, then the kept rows moved by -4, up to (not with) the last token.
    assert whole.order == Order(load=(LoadSource(None, old, (RowRun(0, 0, 6), RowRun(10, 6, 11))),))
    assert build.rotated == 11 and build.inserted == 0
    assert build.recipe == recipe_of(P, padded(new, 4), 18)


def test_each_inserted_run_is_computed_by_its_own_request_then_loaded() -> None:
    build, new = _build([Edit(6, 10, (1,))])
    first, whole = build.requests
    old = padded(OLD, 4)
    assert first.tokens == padded(new[:7], 4) and first.length == 7  # new[6] is the run
    assert first.order == Order(load=(LoadSource(None, old, (RowRun(0, 0, 6),)),))
    # The whole sequence: the first request's rows as they are (the run with them), then
    # every kept row rotated by -3.
    assert whole.order == Order(
        load=(
            LoadSource(P, first.tokens, (RowRun(0, 0, 7),)),
            LoadSource(None, old, (RowRun(10, 7, 11),)),
        )
    )
    assert build.inserted == 1 and build.rotated == 11


def test_two_runs_get_two_requests_each_reading_the_one_before() -> None:
    build, new = _build([Edit(2, 3, (1,)), Edit(9, 10, (1, 2, 3))])
    first, second, whole = build.requests
    assert (first.length, second.length, whole.length) == (3, 12, len(new))
    assert second.order.load[0] == LoadSource(P, first.tokens, (RowRun(0, 0, 3),))
    assert second.order.load[1].runs == (RowRun(3, 3, 6),)  # old 3..8, not moved
    assert whole.order.load[0] == LoadSource(P, second.tokens, (RowRun(0, 0, 12),))


def test_the_old_partial_block_is_needed_only_for_a_kept_row_before_the_last() -> None:
    cut = apply_edits(OLD, [Edit(6, 10, ())])
    assert old_rows_needed(cut.position_map, len(cut.tokens), 22, 4)  # old 20 -> new 16
    assert not old_rows_needed(cut.position_map, len(cut.tokens), 20, 4)  # aligned
    tail = apply_edits(OLD, [Edit(18, 21, ())])  # keeps old 21 only: the new last token
    assert not old_rows_needed(tail.position_map, len(tail.tokens), 22, 4)


def test_a_recipe_keeps_only_the_rows_before_a_position() -> None:
    recipe = recipe_of(P, tuple(range(8)), 7)
    assert recipe_within(recipe, 5) == recipe_of(P, tuple(range(8)), 5)
    assert recipe_within(recipe, 0) is None and recipe_within(None, 5) is None


def test_a_run_that_ends_the_sequence_is_built_by_its_own_request_only() -> None:
    build, new = _build([Edit(6, 10, ()), Edit(22, 22, (1, 2))])  # a cut, then two appended
    (last,) = build.requests
    assert last.tokens == padded(new, 4) and last.length == len(new)
    assert last.order.load[0].runs == (RowRun(0, 0, 6), RowRun(10, 6, 12))  # up to the run
    assert build.recipe == recipe_of(P, padded(new, 4), len(new))
