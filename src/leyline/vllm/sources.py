"""Where vLLM cached a (salt, tokens) sequence, and the purge of it (the engine core's side).

vLLM caches full blocks under chained hashes of their tokens, the request's ``cache_salt``
entering the first block's hash only, so two salts share no block. The hashes here come
from vLLM's own request hasher applied to a real ``Request``, with the algorithm the
engine core uses, so they are the scheduler's exactly. The hasher's seed (``NONE_HASH``) is
set once per process by the engine core (``init_none_hash``); calling that again would
change every hash, so this module never does.

One KV cache group whose block size is the hash block size; anything else is refused
(``unsupported_layout``), as is a pool without prefix caching (``unsupported_runtime``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, get_request_block_hasher
from vllm.v1.request import Request

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.fallback import FallbackReason

_GROUPS = [0]  # the one KV cache group


class BlockSources:
    """Block hashes of (salt, tokens), the cached blocks they name, and their eviction."""

    def __init__(self, pool: BlockPool, block_size: int, hash_algo: str) -> None:
        self.pool = pool
        self.block_size = block_size
        self._hasher = get_request_block_hasher(block_size, get_hash_fn_by_name(hash_algo))

    @classmethod
    def for_cache(cls, kv_cache_config: Any, hash_algo: str, pool: BlockPool) -> BlockSources:
        """Sources over the scheduler's ``pool`` (from ``bind_gpu_block_pool``), or refuse a
        cache they cannot address. ``hash_algo``: ``cache_config.prefix_caching_hash_algo``."""
        if not pool.enable_caching:
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_runtime,
                "prefix caching is off: nothing is cached to splice from or purge",
            )
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_layout,
                f"{len(groups)} KV cache groups (sliding window or hybrid model): sources "
                "are found for one group only",
            )
        block_size = int(groups[0].kv_cache_spec.block_size)
        if pool.hash_block_size != block_size:
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_layout,
                f"blocks of {block_size} tokens hashed per {pool.hash_block_size}",
            )
        return cls(pool, block_size, hash_algo)

    def hashes(self, cache_salt: str | None, tokens: Sequence[int]) -> list[BlockHash]:
        """The hash of every full block of ``tokens`` under ``cache_salt``."""
        request = Request(
            request_id="leyline-sources",
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=self._hasher,
        )
        return list(request.block_hashes)

    def cached_prefix(self, cache_salt: str | None, tokens: Sequence[int]) -> list[int]:
        """Block ids of the longest run of cached full blocks from the first one on."""
        found: list[int] = []
        for block_hash in self.hashes(cache_salt, tokens):
            blocks = self.pool.get_cached_block(block_hash, _GROUPS)
            if blocks is None:
                break
            found.append(blocks[0].block_id)
        return found

    def purge_from(self, cache_salt: str | None, tokens: Sequence[int], position: int) -> list[int]:
        """Evict every cached block of ``tokens`` from the one holding ``position`` on (all
        copies of each, and past a block that is already gone); returns their ids. A block a
        running request holds keeps its data until freed but is never matched again."""
        if position < 0:
            raise ValueError(f"position {position} < 0")
        evicted: list[int] = []
        for block_hash in self.hashes(cache_salt, tokens)[position // self.block_size :]:
            while (blocks := self.pool.get_cached_block(block_hash, _GROUPS)) is not None:
                block_id = blocks[0].block_id
                if block_id in evicted:  # never loop on a block the pool kept
                    break
                self.pool.evict_blocks({block_id})
                evicted.append(block_id)
        return evicted
