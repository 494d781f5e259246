"""The requests a private build runs (``build.plan_build``): one prefix per inserted run,
rounded up to a block, and only rows whose source block is cached."""

from __future__ import annotations

from leyline.protocol.algebra import Edit, apply_edits
from leyline.vllm.build import plan_build
from leyline.vllm.link import RowRun

OLD = tuple(range(100, 122))  # 22 tokens


def _plan(edits: list[Edit], computed: int = len(OLD), block: int = 4) -> tuple[int, ...]:
    result = apply_edits(OLD, edits)
    build = plan_build(result.position_map, len(result.tokens), computed, block)
    return build.prefix_ends


def test_a_cut_needs_no_prefix_request_and_stops_at_the_uncached_block() -> None:
    result = apply_edits(OLD, [Edit(6, 10, ())])
    build = plan_build(result.position_map, len(result.tokens), len(OLD), 4)
    assert build.runs == (RowRun(0, 0, 6), RowRun(10, 6, 10))  # old 20, 21: never cached
    assert build.prefix_ends == () and build.loaded == 16


def test_each_inserted_run_gets_a_prefix_rounded_up_to_a_block() -> None:
    assert _plan([Edit(6, 10, (1,))]) == (8,)
    assert _plan([Edit(2, 3, (1,)), Edit(9, 10, (1, 2, 3))]) == (4, 12)
    assert _plan([Edit(1, 2, (1,)), Edit(3, 4, (1,))]) == (4,)  # one block holds both


def test_a_run_in_the_last_block_is_left_to_the_whole_request() -> None:
    assert _plan([Edit(19, 20, (1,))]) == ()
    assert _plan([Edit(6, 10, (1,))], computed=6) == ()  # nothing kept is cached after it
