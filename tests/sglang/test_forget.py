"""FORGET: the old sequence's cache past the edit point is dropped from the real trees.

All three trees: legacy ``RadixCache`` and ``UnifiedRadixCache`` with the Rust tree core
(the server default) and the Python one. The Rust core panics and poisons itself if asked
to drop a node that still has children, so every test also checks that the tree is still
usable afterwards.
"""

from __future__ import annotations

import pytest
import torch

from leyline.sglang.forget import forget_after
from leyline.sglang.tree_ops import TreeOps

from ._stack import TREE_KINDS, Stack, TreeKind, build, free_slot_count

OLD = list(range(100, 180))
GENERATED = list(range(500, 512))
"""What a generation appended to OLD (cached below OLD's last node)."""


def _cache(stack: Stack, tokens: list[int]) -> None:
    """Insert ``tokens`` as a finished request would: the tree's matched prefix, fresh
    slots for the rest."""
    ops = TreeOps(stack.tree)
    n = len(tokens) - len(tokens) % ops.page_size
    prefix = ops.match(tokens[:n])
    fresh = stack.allocator.alloc(n - prefix.length).to(torch.int64)
    ops.insert(tokens[:n], torch.cat([prefix.slots, fresh]), owned=prefix.length)


def _check_clean(stack: Stack) -> None:
    """The tree passes its own sanity check; after evicting everything every slot is free,
    none twice."""
    if stack.tree.__class__.__name__ == "UnifiedRadixCache":
        stack.tree.tree_core.sanity_check([], [])
    TreeOps(stack.tree).evict_all()
    assert free_slot_count(stack) == (stack.size, stack.size)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_forget_drops_everything_past_the_edit_point(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD)
    ops = TreeOps(stack.tree)
    out = forget_after(ops, OLD, 30)
    assert (out.kept_prefix, out.purged) == (30, True)
    assert ops.match(OLD).length == 30
    assert stack.allocator.available_size() == stack.size - 30
    _check_clean(stack)


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize(("page_size", "at", "kept"), [(1, 30, 30), (4, 31, 28)])
def test_forget_drops_what_a_generation_appended(
    kind: TreeKind, page_size: int, at: int, kept: int
) -> None:
    """OLD's last node is no longer a leaf: the generation's node hangs below it. On pages
    of 4, the edit point is rounded down to a page (31 -> 28)."""
    stack = build(kind, page_size=page_size)
    stack.prefill(OLD)
    _cache(stack, OLD + GENERATED)
    ops = TreeOps(stack.tree)
    out = forget_after(ops, OLD, at)
    assert (out.kept_prefix, out.purged) == (kept, True)
    assert ops.match(OLD + GENERATED).length == kept
    assert stack.allocator.available_size() == stack.size - kept
    _check_clean(stack)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_forget_drops_branches_after_the_edit_point_and_keeps_those_before(
    kind: TreeKind,
) -> None:
    stack = build(kind)
    stack.prefill(OLD)
    after = OLD[:50] + list(range(900, 920))  # shares the forgotten span: derived from it
    before = OLD[:20] + list(range(700, 730))  # branches off before the edit point
    other = list(range(300, 340))  # shares nothing
    for tokens in (after, before, other):
        _cache(stack, tokens)
    ops = TreeOps(stack.tree)
    out = forget_after(ops, OLD, 30)
    assert (out.kept_prefix, out.purged) == (30, True)
    assert ops.match(after).length == 30
    assert ops.match(before).length == len(before)
    assert ops.match(other).length == len(other)
    assert stack.allocator.available_size() == stack.size - 30 - 30 - 40
    _check_clean(stack)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_forget_keeps_what_a_running_request_locks(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD)
    ops = TreeOps(stack.tree)
    handle = ops.lock(ops.match(OLD).node)
    out = forget_after(ops, OLD, 30)
    assert out.purged is False  # (and the Rust core is not asked: no panic)
    assert ops.match(OLD).length == len(OLD)
    ops.unlock(handle)
    assert forget_after(ops, OLD, 30).purged is True  # once the request ended
    assert ops.match(OLD).length == 30
    _check_clean(stack)


@pytest.mark.parametrize("kind", ("unified-rust", "unified-python"))
def test_forget_drops_the_unlocked_part_below_a_locked_node(kind: TreeKind) -> None:
    """A request holds OLD[:50]; what hangs below it (nobody holds it) is dropped, and the
    held node, now a locked leaf, is declined by the core, not forced."""
    stack = build(kind)
    stack.prefill(OLD)
    _cache(stack, OLD + GENERATED)
    ops = TreeOps(stack.tree)
    handle = ops.lock(ops.match(OLD[:50]).node)
    out = forget_after(ops, OLD, 30)
    assert (out.kept_prefix, out.purged) == (30, False)
    assert ops.match(OLD + GENERATED).length == 50
    ops.unlock(handle)
    assert forget_after(ops, OLD, 30).purged is True
    assert ops.match(OLD).length == 30
    _check_clean(stack)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_forget_with_nothing_cached_past_the_edit_point(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD[:30])
    ops = TreeOps(stack.tree)
    assert forget_after(ops, OLD, 30) == forget_after(ops, OLD, 40)
    out = forget_after(ops, OLD, 50)
    assert (out.kept_prefix, out.purged) == (30, True)
    assert ops.match(OLD).length == 30
    _check_clean(stack)
