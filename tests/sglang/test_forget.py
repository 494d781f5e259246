"""FORGET: the old sequence's cache past the edit point is dropped from the real trees."""

from __future__ import annotations

import pytest

from leyline.server_adapter.sglang.forget import forget_after
from leyline.server_adapter.sglang.tree_ops import TreeOps

from ._stack import TREE_KINDS, TreeKind, build, free_slot_count

OLD = list(range(100, 180))


PURGING = ("legacy", "unified-python")


def test_forget_under_the_rust_core_leaves_the_purge_to_eviction() -> None:
    stack = build("unified-rust")
    stack.prefill(OLD)
    ops = TreeOps(stack.tree)
    out = forget_after(ops, OLD, 30)
    assert (out.kept_prefix, out.purged) == (30, False)
    assert ops.match(OLD).length == len(OLD)  # still usable: nothing was half-dropped


@pytest.mark.parametrize("kind", PURGING)
def test_forget_drops_everything_past_the_edit_point(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD)
    ops = TreeOps(stack.tree)
    out = forget_after(ops, OLD, 30)
    assert (out.kept_prefix, out.purged) == (30, True)
    assert ops.match(OLD).length == 30
    assert stack.allocator.available_size() == stack.size - 30
    ops.evict_all()
    assert free_slot_count(stack) == (stack.size, stack.size)


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


@pytest.mark.parametrize("kind", PURGING)
def test_forget_on_pages_rounds_the_edit_point_down(kind: TreeKind) -> None:
    stack = build(kind, page_size=4)
    stack.prefill(OLD)
    ops = TreeOps(stack.tree)
    out = forget_after(ops, OLD, 31)
    assert (out.kept_prefix, out.purged) == (28, True)
    assert ops.match(OLD).length == 28
