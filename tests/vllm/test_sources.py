"""``sources`` against a real ``KVCacheManager`` and its ``BlockPool`` (CPU torch): the
blocks a request cached are found by (salt, tokens), and purged from a position on."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.fallback import FallbackReason
from leyline.vllm.sources import BlockSources

BLOCK = 16
TOKENS = list(range(1000, 1070))  # 4 full blocks and 6 tokens
_request_ids = itertools.count()


def _config(groups: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{g}"], spec) for g in range(groups)],
    )


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(
        _config(), max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK
    )


@pytest.fixture
def sources(manager: KVCacheManager) -> BlockSources:
    return BlockSources.for_cache(_config(), "sha256", manager.block_pool)


def _request(salt: str | None, tokens: Sequence[int]) -> Request:
    """A request as the engine core builds it: its hasher hashes the prompt's blocks."""
    return Request(
        f"r{next(_request_ids)}",
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256")),
    )


def _prefill(
    manager: KVCacheManager,
    salt: str | None,
    tokens: Sequence[int],
    *,
    lookup: bool = True,
    finish: bool = True,
) -> list[int]:
    """Schedule a request's whole prompt as the scheduler does; returns its block ids."""
    request = _request(salt, tokens)
    hit, computed = manager.empty_kv_cache_blocks, 0
    if lookup:
        hit, computed, _ = manager.get_computed_blocks(request)
    allocated = manager.allocate_slots(request, len(tokens) - computed, computed, hit)
    assert allocated is not None
    request.num_computed_tokens = len(tokens)
    block_ids = list(manager.get_block_ids(request.request_id)[0])
    if finish:
        manager.free(request)
    return block_ids


def _vllm_hit(manager: KVCacheManager, salt: str | None, tokens: Sequence[int]) -> int:
    """Tokens vLLM's own lookup finds cached for a new request (capped at all but one)."""
    return manager.get_computed_blocks(_request(salt, tokens))[1]


def test_the_blocks_a_request_cached_are_found(
    manager: KVCacheManager, sources: BlockSources
) -> None:
    ids = _prefill(manager, "s1", TOKENS)
    assert sources.hashes("s1", TOKENS) == _request("s1", TOKENS).block_hashes
    assert sources.cached_prefix("s1", TOKENS) == ids[:4]
    assert sources.cached_prefix("s1", [*TOKENS, 7, 8, 9]) == ids[:4]
    diverged = [*TOKENS[:40], 5, *TOKENS[41:]]  # differs inside block 2
    assert sources.cached_prefix("s1", diverged) == ids[:2]
    assert _vllm_hit(manager, "s1", [*TOKENS[:64], 1]) == 64  # vLLM agrees: 4 blocks


def test_another_salt_finds_none(manager: KVCacheManager, sources: BlockSources) -> None:
    _prefill(manager, "s1", TOKENS)
    assert sources.cached_prefix("s2", TOKENS) == []
    assert sources.cached_prefix(None, TOKENS) == []
    unsalted = _prefill(manager, None, TOKENS)
    assert sources.cached_prefix(None, TOKENS) == unsalted[:4]


def test_purge_stops_lookups_at_the_block_holding_the_position(
    manager: KVCacheManager, sources: BlockSources
) -> None:
    ids = _prefill(manager, "s1", TOKENS)
    other = _prefill(manager, "s2", TOKENS)
    assert sorted(sources.purge_from("s1", TOKENS, 40)) == sorted(ids[2:4])
    assert sources.cached_prefix("s1", TOKENS) == ids[:2]
    assert _vllm_hit(manager, "s1", TOKENS) == 2 * BLOCK
    assert sources.cached_prefix("s2", TOKENS) == other[:4]
    assert sources.purge_from("s1", TOKENS, 40) == []  # nothing left to evict
    assert sources.purge_from("s1", TOKENS, 0) == ids[:2]
    assert _vllm_hit(manager, "s1", TOKENS) == 0


def test_purge_evicts_every_copy_and_blocks_in_use(
    manager: KVCacheManager, sources: BlockSources
) -> None:
    first = _prefill(manager, "s1", TOKENS, finish=False)  # still running
    second = _prefill(manager, "s1", TOKENS, lookup=False)  # computed again: a second copy
    assert set(first[:4]).isdisjoint(second[:4])
    evicted = sources.purge_from("s1", TOKENS, BLOCK)
    assert sorted(evicted) == sorted(first[1:4] + second[1:4])
    assert sources.cached_prefix("s1", TOKENS) in (first[:1], second[:1])
    assert all(
        manager.block_pool.get_cached_block(h, [0]) is None
        for h in sources.hashes("s1", TOKENS)[1:]
    )


def test_caches_sources_cannot_address_are_refused() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK)
    with pytest.raises(SpliceUnsupportedError) as two_groups:
        BlockSources.for_cache(_config(groups=2), "sha256", pool)
    assert two_groups.value.reason == FallbackReason.unsupported_layout
    finer = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK // 2)
    with pytest.raises(SpliceUnsupportedError) as sub_blocks:
        BlockSources.for_cache(_config(), "sha256", finer)
    assert sub_blocks.value.reason == FallbackReason.unsupported_layout
    uncached = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=BLOCK)
    with pytest.raises(SpliceUnsupportedError) as no_cache:
        BlockSources.for_cache(_config(), "sha256", uncached)
    assert no_cache.value.reason == FallbackReason.unsupported_runtime
