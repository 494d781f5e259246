"""The edit algebra against a naive reference on random sequences and batches."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from leyline.protocol import Edit, Mode, apply_edits

VOCAB = st.integers(min_value=0, max_value=5)  # a small vocabulary makes common prefixes likely


@st.composite
def base_and_batch(draw: st.DrawFn) -> tuple[list[int], list[Edit]]:
    base = draw(st.lists(VOCAB, min_size=0, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(base)), min_size=0, max_size=8)))
    edits: list[Edit] = []
    # Non-overlapping spans from consecutive cut pairs (touching and empty spans included).
    for a, b in zip(cuts[::2], cuts[1::2], strict=False):
        replacement = tuple(draw(st.lists(VOCAB, max_size=6)))
        if a == b and not replacement:
            replacement = (draw(VOCAB),)
        mode = draw(st.sampled_from([Mode.amortize, Mode.amortize, Mode.forget]))
        edits.append(Edit(a, b, replacement, mode))
    order = draw(st.permutations(range(len(edits))))
    shuffled = [edits[i] for i in order]
    return base, [Edit(e.start, e.end, e.replacement, e.mode, i) for i, e in enumerate(shuffled)]


Case = tuple[list[int], list[Edit]]
"""A base sequence and a batch of edits on it (``base_and_batch``)."""


def on_random_batches(examples: int) -> Callable[[Callable[[Case], None]], Callable[[], None]]:
    """A property test over ``examples`` random cases of ``base_and_batch``."""

    def wrap(test: Callable[[Case], None]) -> Callable[[], None]:
        return settings(max_examples=examples, deadline=None)(given(base_and_batch())(test))

    return wrap


def naive(base: list[int], edits: list[Edit]) -> tuple[list[int], list[int | None], int | None]:
    """Splice (token, old index) pairs right to left; a sentinel marks where forgetting starts."""
    items: list[tuple[int, int | None] | None] = [(t, i) for i, t in enumerate(base)]
    for edit in sorted(edits, key=lambda e: (e.start, e.end, e.index), reverse=True):
        start, replacement = edit.start, list(edit.replacement)
        while start < edit.end and replacement and base[start] == replacement[0]:
            start, replacement = start + 1, replacement[1:]
        if start == edit.end and not replacement:
            continue
        sentinel: list[tuple[int, int | None] | None] = [None] if edit.mode is Mode.forget else []
        items[start : edit.end] = sentinel + [(t, None) for t in replacement]
    forget_from = next((k for k, item in enumerate(items) if item is None), None)
    kept = [item for item in items if item is not None]
    old_to_new: list[int | None] = [None] * len(base)
    for new, (_, old) in enumerate(kept):
        if old is not None:
            old_to_new[old] = new
    return [t for t, _ in kept], old_to_new, forget_from


@on_random_batches(400)
def test_sequence_and_position_map_match_naive_reference(case: Case) -> None:
    base, edits = case
    result = apply_edits(base, edits)
    tokens, old_to_new, _ = naive(base, edits)
    assert list(result.tokens) == tokens
    assert result.position_map.as_list() == old_to_new
    for old, new in enumerate(old_to_new):
        assert result.position_map.new_position(old) == new


@on_random_batches(400)
def test_runs_cover_the_new_sequence_with_the_right_kinds(case: Case) -> None:
    base, edits = case
    result = apply_edits(base, edits)
    _, old_to_new, forget_from = naive(base, edits)
    new_to_old: dict[int, int] = {n: o for o, n in enumerate(old_to_new) if n is not None}
    position = 0
    for run in result.runs:
        assert run.new_start == position and len(run) > 0
        for new in range(run.new_start, run.new_end):
            if run.kind == "inserted":
                assert new not in new_to_old
            else:
                assert new_to_old[new] == run.old_start + (new - run.new_start)  # type: ignore[operator]
                forgotten = forget_from is not None and new >= forget_from
                assert (run.kind == "recompute") == forgotten
        position = run.new_end
    assert position == len(result.tokens)
    assert result.reused_tokens + result.prefilled_tokens == len(result.tokens)


@on_random_batches(300)
def test_delta_of_every_survivor_is_the_net_length_change_before_it(case: Case) -> None:
    base, edits = case
    result = apply_edits(base, edits)
    for old in range(len(base)):
        new = result.position_map.new_position(old)
        if new is None:
            continue
        before = [e for e in edits if e.end <= old and not (e.start == e.end == old)]
        expected = sum(len(e.replacement) - (e.end - e.start) for e in before)
        # Insertions exactly at `old` land before it, as do all edits ending at or before it.
        expected += sum(len(e.replacement) for e in edits if e.start == e.end == old)
        assert result.position_map.delta(old) == expected == new - old


@settings(max_examples=200, deadline=None)
@given(st.lists(VOCAB, min_size=1, max_size=40), st.data())
def test_splicing_a_span_with_itself_is_the_identity(base: list[int], data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(base) - 1))
    end = data.draw(st.integers(start + 1, len(base)))
    mode = data.draw(st.sampled_from(list(Mode)))
    result = apply_edits(base, [Edit(start, end, tuple(base[start:end]), mode)])
    assert result.tokens == tuple(base)
    assert result.is_identity
    assert result.position_map.as_list() == list(range(len(base)))
    assert result.rotated_tokens == result.prefilled_tokens == 0
