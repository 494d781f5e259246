"""Lineages: where each published sequence's tokens are now, through edits and re-prefills."""

from __future__ import annotations

from leyline.core.lineage import Lineages
from leyline.protocol.algebra import Edit, apply_edits


def test_a_grown_publication_replaces_its_prefix() -> None:
    lineages = Lineages()
    lineages.published(range(8))
    lineages.published(range(12))
    assert len(lineages) == 1
    assert lineages.forgotten([(4, 6)]) == [(tuple(range(12)), 4)]


def test_positions_follow_edits_and_forgotten_spans_map_back() -> None:
    base = list(range(100, 140))
    lineages = Lineages()
    lineages.published(base)
    result = apply_edits(base, [Edit(2, 4, (1, 1, 1))])  # +1 from position 4 on
    lineages.moved(result.position_map)
    lineages.published(result.tokens[:2])  # only the exact prefix is published again
    # Forget [17, 25) now = old [16, 24): the first lineage from 16; the second holds none.
    assert lineages.forgotten([(17, 25)]) == [(tuple(base), 16)]
    # A span made only of the inserted tokens is in no earlier publication.
    assert lineages.forgotten([(2, 5)]) == []


def test_a_reprefill_keeps_the_shared_head_and_tail_in_place() -> None:
    old = list(range(100, 140))
    new = [*old[:2], 1, 1, 1, *old[4:]]
    lineages = Lineages()
    lineages.published(old)
    lineages.realigned(old, new)
    assert lineages.forgotten([(17, 25)]) == [(tuple(old), 16)]
    assert lineages.forgotten([(2, 5)]) == []  # the edited region maps nowhere
    lineages.realigned(new, [9] * 50)  # nothing shared: the lineage drops out
    assert len(lineages) == 0


def test_a_resent_edit_with_new_turns_appended_still_maps_the_old_copy() -> None:
    old = list(range(100, 140))
    new = [*old[:2], 1, 1, 1, *old[4:], 7, 7, 7, 7]  # edited early, new turns at the end
    lineages = Lineages()
    lineages.published(old)
    lineages.realigned(old, new)
    assert lineages.forgotten([(17, 25)]) == [(tuple(old), 16)]


def test_filler_after_a_sequence_follows_no_edit_but_is_purged_with_it() -> None:
    """A sequence cached with filler to fill its last block (vLLM): the filler has no
    position, so edits never move it, and a forget purges the whole cached sequence from
    the forgotten token on."""
    lineages = Lineages()
    lineages.published([*range(100, 110), 109, 109], length=10)
    result = apply_edits(list(range(100, 110)), [Edit(2, 4, ())])  # every position < 10
    lineages.moved(result.position_map)
    assert lineages.forgotten([(6, 7)]) == [((*range(100, 110), 109, 109), 8)]
    assert lineages.forgotten([(8, 9)]) == []  # past the sequence: nothing of it is there
