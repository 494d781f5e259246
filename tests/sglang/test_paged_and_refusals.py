"""Page sizes above 1, and refusals that must leave pool, allocator and tree untouched."""

from __future__ import annotations

from typing import TypeVar

import pytest
import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.algebra import Edit
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.fallback import FallbackReason
from leyline.sglang.tree_ops import TreeOps

from ._stack import LORA, TREE_KINDS, Stack, TreeKind, build, free_slot_count

OLD = list(range(100, 180))
E = TypeVar("E", bound=Exception)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    bufs_a, bufs_b = a[0], b[0]
    assert isinstance(bufs_a, list) and isinstance(bufs_b, list)
    return all(torch.equal(x, y) for x, y in zip(bufs_a, bufs_b, strict=True)) and a[1:] == b[1:]


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_paged_splice_rematches_full_pages_and_reports_the_partial_tail(kind: TreeKind) -> None:
    stack = build(kind, page_size=4)
    stack.prefill(OLD)
    out = stack.executor().splice(OLD, [Edit(21, 50)])  # 51 tokens: 12 pages + 3
    assert len(out.tokens) == 51
    assert out.cached_tokens == 48
    assert out.fallback_reason is FallbackReason.page_alignment
    ops = TreeOps(stack.tree)
    assert ops.match(list(out.tokens)).length == 48
    old_slots, new_slots = ops.match(OLD).slots, ops.match(list(out.tokens)).slots
    assert torch.equal(new_slots[:20], old_slots[:20])  # whole pages before the edit shared
    assert not bool(torch.isin(new_slots[20:], old_slots).any())  # the edit's page is fresh
    assert bool((new_slots % 4 == torch.arange(48) % 4).all())  # in-page offsets kept
    for buf in stack.pool.kv_buffer:  # token 20 shares the edit's page: copied bitwise
        assert torch.equal(buf[new_slots[20]], buf[old_slots[20]])
        assert torch.equal(buf[new_slots[21:48], 0, :LORA], buf[old_slots[50:77], 0, :LORA])
    ops.evict_all()
    assert free_slot_count(stack) == (stack.size, stack.size)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_paged_cut_needs_the_source_only_as_far_as_it_builds(kind: TreeKind) -> None:
    """The old sequence ends mid-page (82 = 20 pages + 2): the tree never holds its last
    two tokens, so the build stops where the cached source ends, instead of refusing."""
    stack = build(kind, page_size=4)
    old = list(range(100, 182))
    stack.prefill(old)  # caches 80
    out = stack.executor().splice(old, [Edit(21, 30)])  # 73 tokens; source cached to new 71
    assert out.pending_prefill is None
    assert out.cached_tokens == 68  # floor_page(71)
    assert out.fallback_reason is FallbackReason.page_alignment
    ops = TreeOps(stack.tree)
    old_slots, new_slots = ops.match(old).slots, ops.match(list(out.tokens)).slots
    assert len(new_slots) == 68
    for buf in stack.pool.kv_buffer:  # downstream latents moved bitwise (rope band rotated)
        assert torch.equal(buf[new_slots[21:68], 0, :LORA], buf[old_slots[30:77], 0, :LORA])
    ops.evict_all()
    assert free_slot_count(stack) == (stack.size, stack.size)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_paged_replacement_is_prefilled_to_the_end_of_its_page(kind: TreeKind) -> None:
    """A 2-token replacement at 21 ends mid-page (23): the plugin asks for a prefill to the
    end of that page (24), which the tree can hold, so the repeated call builds the rest."""
    stack = build(kind, page_size=4)
    stack.prefill(OLD)
    edits = [Edit(21, 30, (7, 8))]
    first = stack.executor().splice(OLD, edits)
    assert first.pending_prefill == 24
    assert first.cached_tokens == 20
    assert stack.extend(list(first.tokens[:24])) == 4
    out = stack.executor().splice(OLD, edits)
    assert out.pending_prefill is None
    assert len(out.tokens) == 73
    assert out.cached_tokens == 72  # 73 = 18 pages + 1: the last, moved token is left to
    assert out.fallback_reason is None  # the generate by rule (3.1), not by page rounding
    ops = TreeOps(stack.tree)
    old_slots, new_slots = ops.match(OLD).slots, ops.match(list(out.tokens)).slots
    for buf in stack.pool.kv_buffer:  # from the page after the replacement: old KV, moved
        assert torch.equal(buf[new_slots[24:72], 0, :LORA], buf[old_slots[31:79], 0, :LORA])
    ops.evict_all()
    assert free_slot_count(stack) == (stack.size, stack.size)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_paged_replacement_in_the_last_partial_page_stops_the_build(kind: TreeKind) -> None:
    stack = build(kind, page_size=4)
    stack.prefill(OLD)
    out = stack.executor().splice(OLD, [Edit(78, 80, (7,))])  # 79 tokens: 19 pages + 3
    assert out.pending_prefill is None  # no prefill could add a whole page
    assert out.cached_tokens == 76
    assert out.fallback_reason is FallbackReason.page_alignment


def _refused(stack: Stack, edit: Edit, error: type[E]) -> E:
    """The splice of ``edit`` on ``OLD`` raises ``error``, leaving pool, allocator and
    tree as they were."""
    before = stack.snapshot()
    with pytest.raises(error) as info:
        stack.executor().splice(OLD, [edit])
    assert _same(before, stack.snapshot())
    return info.value


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_missing_source_changes_nothing(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD[:40])  # the cache lost the old sequence's tail
    refusal = _refused(stack, Edit(10, 20), SpliceUnsupportedError)
    assert refusal.reason is FallbackReason.missing_source


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_invalid_span_changes_nothing(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD)
    assert _refused(stack, Edit(70, 90), LeylineError).code is ErrorCode.invalid_span


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_no_room_changes_nothing(kind: TreeKind) -> None:
    stack = build(kind, size=96)
    stack.prefill(OLD)  # 80 of 96 slots, locked by nothing but needed as the source
    refusal = _refused(stack, Edit(1, 5), LeylineError)  # needs 75 fresh slots
    assert refusal.code is ErrorCode.limit_exceeded


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_failure_mid_write_frees_the_fresh_slots(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD)
    free_before, tree_before = stack.snapshot()[1:], TreeOps(stack.tree).match(OLD).slots
    bad_rows = {20: [[torch.zeros(3, 1, 7)], [torch.zeros(3, 1, 7)]]}  # wrong row width
    with pytest.raises(RuntimeError):
        stack.executor().splice(OLD, [Edit(20, 50, (1, 2, 3))], inserted_rows=bad_rows)
    assert stack.snapshot()[1:] == free_before
    assert torch.equal(TreeOps(stack.tree).match(OLD).slots, tree_before)


def test_disabled_radix_cache_is_refused() -> None:
    stack = build("legacy")
    stack.tree.disable = True  # as --disable-radix-cache builds it
    with pytest.raises(SpliceUnsupportedError) as info:
        TreeOps(stack.tree)
    assert info.value.reason is FallbackReason.unsupported_runtime


def test_hierarchical_cache_is_refused() -> None:
    stack = build("unified-python")
    # init_hicache needs a host pool and server args; what it leaves behind is this field.
    stack.tree.cache_controller = object()
    with pytest.raises(SpliceUnsupportedError) as info:
        TreeOps(stack.tree)
    assert info.value.reason is FallbackReason.unsupported_runtime
    assert "hierarchical" in info.value.message


def test_fp8_pool_is_refused() -> None:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from leyline.sglang.kv_rows import kv_rows_for
    from leyline.sglang.rope_source import band_of

    from ._stack import deepseek_rope

    pool = MLATokenToKVPool(16, 1, torch.float8_e4m3fn, 32, 16, 1, "cpu", False)
    with pytest.raises(SpliceUnsupportedError) as info:
        kv_rows_for(pool, band_of(deepseek_rope()))
    assert info.value.reason is FallbackReason.unsupported_layout
