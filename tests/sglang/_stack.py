"""Real SGLang cache stacks for the tests: MLA pool, allocator, req->token pool, tree."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Literal

import torch
from sglang.srt.layers.rotary_embedding import base as rope_base
from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from leyline.sglang.executor import SpliceExecutor
from leyline.sglang.kv_rows import kv_rows_for
from leyline.sglang.rope_source import band_of
from leyline.sglang.tree_ops import TreeOps

TreeKind = Literal["legacy", "unified-rust", "unified-python"]
TREE_KINDS: tuple[TreeKind, ...] = ("legacy", "unified-rust", "unified-python")
LORA, ROPE, LAYERS = 32, 16, 2


def deepseek_rope() -> DeepseekScalingRotaryEmbedding:
    """DeepSeek-V2's YaRN rope as SGLang builds it: interleaved, mscale != 1.

    Without a CPU engine, SGLang's platform check would pick a compiled fallback kernel at
    construction (vllm's); the tests call ``forward_native`` only, so the module's platform
    flag is set to CPU for the construction.
    """
    saved = rope_base._is_cpu
    rope_base._is_cpu = True
    try:
        return DeepseekScalingRotaryEmbedding(
            ROPE, ROPE, 256, 10000, False, 4.0, torch.float32,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.0, device="cpu",
        )  # fmt: skip
    finally:
        rope_base._is_cpu = saved


def rope_at(
    rope: DeepseekScalingRotaryEmbedding, positions: torch.Tensor, raw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's own rotation of ``raw`` ``[n, ROPE]`` keys at ``positions`` (fp32)."""
    key = raw.unsqueeze(1).clone()
    return rope.forward_native(positions, torch.zeros_like(key), key)


@dataclass
class Stack:
    pool: MLATokenToKVPool
    allocator: Any
    req_to_token: ReqToTokenPool
    tree: Any
    rope: DeepseekScalingRotaryEmbedding
    size: int
    raw_band: dict[int, torch.Tensor]
    """slot -> the unrotated fp32 k_pe written there (for the reference check)."""

    def executor(self) -> SpliceExecutor:
        rows = kv_rows_for(self.pool, band_of(self.rope))
        return SpliceExecutor(TreeOps(self.tree), rows, self.req_to_token)

    def prefill(self, tokens: list[int], seed: int = 0) -> torch.Tensor:
        """Stand-in for SGLang's prefill of ``tokens``: allocate, write KV as the model's
        attention would (latent, k_pe rotated by SGLang's rope at its position, bf16),
        insert into the tree. Returns the slots."""
        page = self.pool.page_size
        n = len(tokens) - len(tokens) % page
        slots = self.allocator.alloc(n).to(torch.int64)
        g = torch.Generator().manual_seed(seed)
        positions = torch.arange(n)
        for layer in range(LAYERS):
            latent = torch.randn(n, LORA, generator=g)
            raw = torch.randn(n, ROPE, generator=g)
            _, k_pe = rope_at(self.rope, positions, raw)
            row = torch.cat([latent, k_pe.reshape(n, ROPE)], dim=-1)
            self.pool.kv_buffer[layer][slots] = row.to(self.pool.store_dtype).unsqueeze(1)
            if layer == 0:
                self.raw_band.update({int(s): raw[i] for i, s in enumerate(slots)})
        key = RadixKey(array("q", tokens[:n]))
        prefix = self.tree.insert(InsertParams(key=key, value=slots)).prefix_len
        assert prefix == 0, "prefill expects a fresh sequence"
        return slots

    def extend(self, tokens: list[int], seed: int = 1) -> int:
        """Stand-in for a generate of ``tokens`` whose prefix is cached: new KV for the
        whole pages past the match (random, as ``prefill``), inserted after it. Returns
        how many tokens were added."""
        ops = TreeOps(self.tree)
        match = ops.match(tokens)
        page = self.pool.page_size
        n = len(tokens) - len(tokens) % page
        if n <= match.length:
            return 0
        fresh = self.allocator.alloc(n - match.length).to(torch.int64)
        g = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            row = torch.randn(len(fresh), LORA + ROPE, generator=g)
            self.pool.kv_buffer[layer][fresh] = row.to(self.pool.store_dtype).unsqueeze(1)
        value = torch.cat([match.slots[: match.length].to(torch.int64), fresh])
        assert ops.insert(tokens[:n], value, owned=match.length) == match.length
        return n - match.length

    def snapshot(self) -> tuple[Any, ...]:
        free = sorted(_free_list(self.allocator).tolist())
        values = sorted(self.tree.all_values_flatten().tolist()) if self.tree_size() else []
        return (
            [b.clone() for b in self.pool.kv_buffer],
            free,
            values,
            self.tree.evictable_size(),
            self.tree.protected_size(),
        )

    def tree_size(self) -> int:
        total = self.tree.total_size()
        return int(total[0] if isinstance(total, tuple) else total)


def _free_list(allocator: Any) -> torch.Tensor:
    if isinstance(allocator, PagedTokenToKVPoolAllocator):
        return allocator.get_all_free_pages()
    return torch.cat([allocator.free_pages, allocator.release_pages])


def free_slot_count(stack: Stack) -> tuple[int, int]:
    """(free slots, distinct free slots): equal unless something was freed twice."""
    free = _free_list(stack.allocator)
    per = stack.pool.page_size if isinstance(stack.allocator, PagedTokenToKVPoolAllocator) else 1
    return len(free) * per, len(torch.unique(free)) * per


def build(kind: TreeKind, *, page_size: int = 1, size: int = 512) -> Stack:
    dtype = torch.bfloat16
    pool = MLATokenToKVPool(size, page_size, dtype, LORA, ROPE, LAYERS, "cpu", False)
    if page_size == 1:
        allocator: Any = TokenToKVPoolAllocator(size, dtype, "cpu", pool, False)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype, "cpu", pool, False)
    req_to_token = ReqToTokenPool(4, 2048, "cpu", False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
    )
    if kind == "legacy":
        tree: Any = RadixCache(params)
    else:
        params.tree_components = (ComponentType.FULL,)
        params.tree_core_backend = kind.removeprefix("unified-")
        tree = UnifiedRadixCache(params)
    return Stack(pool, allocator, req_to_token, tree, deepseek_rope(), size, {})
