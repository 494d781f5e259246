"""FORGET on SGLang: its own prefix-trimmed re-prefill, plus a purge of what was derived.

SGLang already re-prefills from the first changed token when a generate sends the edited
prompt (the prefix matches, the rest is computed). What the protocol adds is that nothing
derived from the forgotten span may stay in a shared cache entry nobody holds: the tree
node that starts at the edit point on the old sequence's path is dropped with its whole
subtree (every sequence cached below it: the old one, a generation that extended it, any
other that branched off after the edit point), slots freed, unless a running request
locks part of it. The edit point is rounded down to a page: the unchanged tokens of the
edit's page are re-prefilled with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from leyline.sglang.page_align import floor_page
from leyline.sglang.tree_ops import TreeOps


@dataclass(frozen=True, slots=True)
class ForgetOutcome:
    kept_prefix: int
    """Tokens before the edit point the tree still holds (a generate reuses them)."""
    purged: bool
    """False when a locked node (a running request) kept part of the subtree; what no
    request held is dropped all the same. Retry after the request ends."""


def forget_after(
    tree: TreeOps, old_tokens: Sequence[int], start: int, salt: str | None = None
) -> ForgetOutcome:
    """Purge what the tree holds of ``old_tokens`` (in namespace ``salt``) past ``start``."""
    cut = floor_page(start, tree.page_size)
    prefix = tree.match(old_tokens[:cut], salt)  # splits the node at the edit point
    if prefix.length < cut or len(old_tokens) - cut < tree.page_size:
        return ForgetOutcome(prefix.length, True)  # nothing cached past the edit point
    if tree.kind == "legacy":
        below = tree.match(old_tokens[: cut + tree.page_size], salt)
        if below.length <= cut:
            return ForgetOutcome(cut, True)
        return ForgetOutcome(cut, _drop_legacy(tree, below.node))
    return ForgetOutcome(cut, _drop_unified(tree, old_tokens, cut, salt))


def _drop_unified(tree: TreeOps, old_tokens: Sequence[int], cut: int, salt: str | None) -> bool:
    """Evict the subtree of the node that starts at ``cut`` on the old path.

    The tree core removes leaves only (the Rust core panics, poisoning itself for good, when
    asked to drop a node with children or a lock, and neither core lists a node's children),
    so the subtree goes leaf by leaf through SGLang's own eviction walk, restricted to the
    leaves under that node (``TreeOps.evict_below``). Runs on the scheduler thread between
    batches: nothing else changes the tree meanwhile.
    """
    below = [p for p in tree.path(tree.match(old_tokens, salt).node) if p.path_start >= cut]
    if not below:
        return True  # the tree holds nothing past the edit point
    # ``below[0]`` starts exactly at ``cut``: the first match split the node there.
    tree.evict_below(below[0].node_id)
    return tree.match(old_tokens, salt).length <= cut


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
