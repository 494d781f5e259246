"""FORGET on SGLang: its own prefix-trimmed re-prefill, plus a purge of what was derived.

SGLang already re-prefills from the first changed token when a generate sends the edited
prompt (the prefix matches, the rest is computed). What the protocol adds is that nothing
derived from the forgotten span may stay in a shared cache entry nobody holds: every tree
node below the edit point on the old sequence's path is dropped (slots freed) unless a
running request locks it (legacy tree: the whole subtree; unified tree: the old
sequence's own path, see ``_drop_unified_path``). The edit point is rounded down to a page:
the unchanged tokens of the edit's page are re-prefilled with it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .page_align import floor_page
from .tree_ops import TreeOps


@dataclass(frozen=True, slots=True)
class ForgetOutcome:
    kept_prefix: int
    """Tokens before the edit point the tree still holds (a generate reuses them)."""
    purged: bool
    """False when a locked node (a running request) kept the subtree; retry after it ends."""


def forget_after(tree: TreeOps, old_tokens: Sequence[int], start: int) -> ForgetOutcome:
    cut = floor_page(start, tree.page_size)
    prefix = tree.match(old_tokens[:cut])  # splits the node at the edit point
    if prefix.length < cut or len(old_tokens) - cut < tree.page_size:
        return ForgetOutcome(prefix.length, True)  # nothing cached past the edit point
    below = tree.match(old_tokens[: cut + tree.page_size])
    if below.length <= cut:
        return ForgetOutcome(cut, True)
    if tree.kind == "legacy":
        return ForgetOutcome(cut, _drop_legacy(tree, below.node))
    return ForgetOutcome(cut, _drop_unified_path(tree, old_tokens, cut))


def _drop_unified_path(tree: TreeOps, old_tokens: Sequence[int], cut: int) -> bool:
    """Drop the old sequence's nodes past ``cut``, deepest first (the tree core drops leaves
    only). Python tree core only; other sequences that branch off inside the forgotten span,
    and everything under the Rust core, stay until evicted (``purged`` is False then)."""
    core = tree.tree.tree_core
    if type(core).__name__ != "UnifiedTreeCore":
        # The Rust core panics (and poisons itself) when asked to drop a node that is not
        # a leaf, and it cannot say which nodes are: leave the purge to eviction.
        return False
    deepest = tree.match(old_tokens)
    if tree.unlocked_tail(deepest.node) < deepest.length - cut:
        return False  # a running request holds part of it
    while deepest.length > cut:
        if core.node_by_id(deepest.node).children:
            return False  # another cached sequence extends this one
        if not tree.tree._drop_subtree_no_host(deepest.node, defaultdict(int)):
            return False
        deepest = tree.match(old_tokens)
    return True


def _drop_legacy(tree: TreeOps, node: Any) -> bool:
    """Drop ``node`` and its subtree from a legacy ``RadixCache`` unless any of it is locked."""
    stack, order = [node], []
    while stack:
        current = stack.pop()
        if current.lock_ref > 0:
            return False
        order.append(current)
        stack.extend(current.children.values())
    for current in reversed(order):  # children before parents: each is a leaf when dropped
        tree.allocator.free(current.value)
        tree.tree._delete_leaf(current)
        tree.tree.kv_events.record_remove(current)
    return True
