"""The radix-tree operations a splice needs, over SGLang's two tree families.

* ``RadixCache`` (legacy): ``insert`` never frees; the caller frees the slots it inserted
  that the tree already had (as ``cache_finished_req`` does).
* ``UnifiedRadixCache`` (server default; Rust or Python tree core): ``insert`` frees every
  duplicate slot past ``prev_prefix_len`` itself, so that field must be the length the
  caller took from the tree, else the caller's own free would be a double free.

Refused (``unsupported_runtime``): a disabled tree, hierarchical cache (host/storage tiers
would hold copies the splice does not rewrite), SWA/Mamba components, an external cache
linker, EAGLE bigram keys, and any other tree class.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.fallback import FallbackReason


@dataclass(frozen=True, slots=True)
class Match:
    length: int
    """Cached prefix length (page-aligned)."""
    node: Any
    """The tree's handle of the last matched node (a TreeNode, or a NodeId)."""
    slots: torch.Tensor
    """int64 slots of the matched tokens."""


def _refuse(message: str) -> SpliceUnsupportedError:
    return SpliceUnsupportedError(FallbackReason.unsupported_runtime, message)


class TreeOps:
    def __init__(self, tree: Any) -> None:
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        if type(tree) is RadixCache:
            self.kind = "legacy"
            if tree.is_eagle:
                raise _refuse("EAGLE bigram radix keys are not spliced")
        elif type(tree) is UnifiedRadixCache:
            self.kind = "unified"
            if tree.cache_controller is not None or tree.enable_storage:
                raise _refuse("hierarchical cache (--enable-hierarchical-cache) is on")
            if tree.is_swa_enabled or tree.is_mamba_enabled:
                raise _refuse("SWA/Mamba radix components are not spliced")
            if tree.linker is not None:
                raise _refuse("an external KV cache linker is attached")
        else:
            raise _refuse(f"radix cache {type(tree).__name__} is not supported")
        if tree.disable:
            raise _refuse("the radix cache is disabled (--disable-radix-cache)")
        self.tree = tree
        self.page_size = int(tree.page_size)
        self.allocator = tree.token_to_kv_pool_allocator

    @staticmethod
    def key(tokens: Sequence[int], salt: str | None = None) -> Any:
        """The tree's key for ``tokens`` in namespace ``salt`` (SGLang's ``cache_salt``:
        keys of different salts never share a node; None is the public namespace)."""
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens), cache_salt=salt)

    def match(self, tokens: Sequence[int], salt: str | None = None) -> Match:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        result = self.tree.match_prefix(MatchPrefixParams(key=self.key(tokens, salt)))
        length = int(result.device_prefix_len)
        slots = self.tree.path_device_indices(result.last_device_node)[:length]
        return Match(length, result.last_device_node, slots.to(torch.int64))

    def lock(self, node: Any) -> Any:
        if self.kind == "legacy":
            self.tree.inc_lock_ref(node)
            return node
        return self.tree.lock(node)

    def unlock(self, handle: Any) -> None:
        if self.kind == "legacy":
            self.tree.dec_lock_ref(handle)
        else:
            self.tree.unlock(handle)

    # -- unified tree only ----------------------------------------------------------------

    def path(self, node: Any) -> tuple[Any, ...]:
        """``node``'s root-to-node path, root excluded: ``TreePathNodeInfo``s (node id, token
        span on the path, child count), from the tree core's interface (both cores)."""
        return tuple(self.tree.tree_core.collect_path_info([node])[0])

    def evict_below(self, top: Any) -> None:
        """Evict ``top`` and everything below it that no request locks, and nothing else.

        SGLang's own eviction walk, steered: the walk offers every unlocked leaf (and each
        parent once its last child is gone), and only those whose path runs through ``top``
        are evicted, with the walk's own per-leaf step (slots freed, events recorded). The
        tree core only ever removes leaves, so a locked node and its ancestors stay. Both
        tree cores list and evict the same way (``UnifiedRadixCache._evict_components``).
        """
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        full = ComponentType.FULL
        tracker = {full: 0}
        seen: set[Any] = set()
        self.tree.tree_core.evict_device_start(full, 1 << 62)
        try:
            while True:
                node, progressed = self.tree._evict_device_next_node(full, tracker)
                if node is None:
                    if not progressed:
                        return
                    continue
                if node in seen:
                    return  # defensive: node ids are never re-minted, so the walk is done
                seen.add(node)
                if any(p.node_id == top for p in self.path(node)):
                    backup = self.tree._evict_device_leaf(node, tracker)
                    assert backup is None, "a write-back host tier is refused at construction"
        finally:
            self.tree.tree_core.evict_device_end(full)

    def insert(
        self, tokens: Sequence[int], slots: torch.Tensor, owned: int, salt: str | None = None
    ) -> int:
        """Insert ``tokens`` -> ``slots`` in namespace ``salt``; ``slots[:owned]`` are the
        tree's own (matched there).

        Every slot in ``[owned, len)`` that the tree already had a slot for is freed here,
        once; the rest now belong to the tree. Returns the tree's prior prefix length.
        """
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        params = InsertParams(key=self.key(tokens, salt), value=slots, prev_prefix_len=owned)
        prefix = int(self.tree.insert(params).prefix_len)
        if self.kind == "legacy" and prefix > owned:
            self.allocator.free(slots[owned:prefix])
        return prefix

    def evict_all(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree.evict(EvictParams(num_tokens=1 << 62))

    def evict(self, num_tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree.evict(EvictParams(num_tokens=num_tokens))
