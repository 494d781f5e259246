"""Prefix cache: reuse, block alignment, LRU eviction, references, FORGET purge, errors.

Synthetic KV whose value at position i is a function of tokens[: i + 1] (as real KV is),
so a block cached for one sequence is bitwise what another sequence with the same prefix
would have computed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leyline.engine.kv.block_trie import TrieNode
from leyline.engine.kv.prefix_cache import (
    InvalidConfigError,
    KVCache,
    KVLayoutError,
    LockHandle,
    PrefixCache,
    PrefixCacheError,
    StaleHandleError,
    TokenError,
)

BS = 4


def prefix_codes(tokens: Sequence[int]) -> torch.Tensor:
    """One float64 per position, determined by tokens[: i + 1] (a rolling hash)."""
    h, out = 0, []
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
        out.append(float(h))
    return torch.tensor(out, dtype=torch.float64)


def gqa_kv(tokens: Sequence[int], layers: int = 2, heads: int = 2, dim: int = 3) -> KVCache:
    """(keys, values) per layer, shape [1, heads, T, dim]."""
    code = prefix_codes(tokens).view(1, 1, -1, 1)
    grid = torch.arange(heads * dim, dtype=torch.float64).view(1, heads, 1, dim) / 64
    return tuple(
        tuple((code + grid + layer * 0.5 + slot * 0.25).contiguous() for slot in range(2))
        for layer in range(layers)
    )


def block_bytes(layers: int = 2, heads: int = 2, dim: int = 3) -> int:
    return layers * 2 * heads * BS * dim * 8


def take(kv: KVCache, n: int, seq_dim: int = -2) -> KVCache:
    return tuple(tuple(t.narrow(seq_dim, 0, n) for t in layer) for layer in kv)


def assert_kv_equal(a: KVCache | None, b: KVCache) -> None:
    assert a is not None
    assert len(a) == len(b)
    for la, lb in zip(a, b, strict=True):
        assert len(la) == len(lb)
        for ta, tb in zip(la, lb, strict=True):
            assert torch.equal(ta, tb)


def big_cache(**kw: int) -> PrefixCache:
    return PrefixCache(10**9, block_size=BS, **kw)


# -- reuse and alignment ------------------------------------------------------------------


def test_second_sequence_reuses_shared_prefix_with_identical_kv() -> None:
    cache = big_cache()
    a = list(range(100, 110))  # 10 tokens: 2 full blocks cached, 2 tokens left over
    b = [*a[:9], 7, 7, 7]
    ins = cache.insert(a, gqa_kv(a))
    assert (ins.cached_tokens, ins.inserted_tokens, ins.stored_tokens) == (0, 8, 8)
    res = cache.match(b)
    assert res.matched_tokens == 8
    assert_kv_equal(res.kv, take(gqa_kv(b), 8))
    # b extends the cached prefix: only its new block is stored.
    ins_b = cache.insert(b, gqa_kv(b))
    assert (ins_b.cached_tokens, ins_b.inserted_tokens, ins_b.stored_tokens) == (8, 4, 12)
    s = cache.stats()
    assert (s.hits, s.misses, s.hit_tokens, s.blocks) == (1, 0, 8, 3)
    assert s.bytes_used == 3 * block_bytes()


def test_match_returns_only_whole_blocks() -> None:
    cache = big_cache()
    a = list(range(12))
    cache.insert(a, gqa_kv(a))
    assert cache.match(a[:7]).matched_tokens == 4
    assert cache.match([*a[:3], 99]).matched_tokens == 0  # differs inside the first block
    assert cache.match([*a[:6], 99, 99]).matched_tokens == 4
    miss = cache.match([5, 5, 5, 5])
    assert (miss.matched_tokens, miss.kv, miss.handle) == (0, None, None)
    assert cache.stats().misses == 2


def test_short_insert_stores_nothing() -> None:
    cache = big_cache()
    res = cache.insert([1, 2, 3], gqa_kv([1, 2, 3]))
    assert res.stored_tokens == 0 and cache.stats().blocks == 0


def test_cached_blocks_are_copies_isolated_from_callers() -> None:
    cache = big_cache()
    a = list(range(8))
    kv = gqa_kv(a)
    cache.insert(a, kv)
    kv[0][0].add_(1.0)  # the caller edits its cache in place (e.g. a splice rotating keys)
    got = cache.match(a).kv
    assert got is not None
    assert_kv_equal(got, gqa_kv(a))
    got[1][1].zero_()  # and edits what the cache handed out
    assert_kv_equal(cache.match(a).kv, gqa_kv(a))


def test_mla_layout_with_different_ranks_round_trips() -> None:
    cache = big_cache()
    toks = list(range(9))
    code = prefix_codes(toks)
    latent = code.view(1, -1, 1).expand(1, 9, 5).contiguous()  # [1, T, kv_lora_rank]
    rope = code.view(1, 1, -1, 1).expand(1, 1, 9, 2).contiguous()  # [1, 1, T, rope_dim]
    kv = ((latent, rope), (latent * 2, rope * 2))
    assert cache.insert(toks, kv).stored_tokens == 8
    assert_kv_equal(cache.match(toks).kv, take(kv, 8))


def test_custom_sequence_dim() -> None:
    cache = PrefixCache(10**9, block_size=BS, seq_dim=1)
    toks = list(range(8))
    keys = prefix_codes(toks).view(1, -1, 1, 1).expand(1, 8, 2, 3).contiguous()  # [1,T,H,D]
    kv = ((keys, keys + 1),)
    cache.insert(toks, kv)
    assert_kv_equal(cache.match([*toks[:5], 0, 0, 0]).kv, take(kv, 4, seq_dim=1))


# -- eviction and references --------------------------------------------------------------


def test_eviction_under_budget_follows_lru_order() -> None:
    cache = PrefixCache(3 * block_bytes(), block_size=BS)
    a, b, c, d = ([k] * BS for k in (1, 2, 3, 4))
    for seq in (a, b, c):
        cache.insert(seq, gqa_kv(seq))
    cache.match(a)  # a becomes the most recently used; b is now the oldest
    res = cache.insert(d, gqa_kv(d))
    assert res.evicted == (1, block_bytes())
    assert cache.match(b).matched_tokens == 0
    assert all(cache.match(s).matched_tokens == BS for s in (a, c, d))
    s = cache.stats()
    assert (s.evicted_blocks, s.blocks, s.bytes_used) == (1, 3, 3 * block_bytes())


def test_eviction_drops_leaves_before_their_parents() -> None:
    cache = PrefixCache(3 * block_bytes(), block_size=BS)
    long = list(range(3 * BS))
    cache.insert(long, gqa_kv(long))
    other = [99] * BS
    cache.insert(other, gqa_kv(other))  # needs one block: the tail of `long` goes
    assert cache.match(long).matched_tokens == 2 * BS


def test_referenced_entries_are_never_evicted() -> None:
    cache = PrefixCache(2 * block_bytes(), block_size=BS)
    a = [1] * (2 * BS)
    handle = cache.insert(a, gqa_kv(a), lock=True).handle
    assert isinstance(handle, LockHandle) and handle.tokens == 2 * BS
    b = [2] * BS
    full = cache.insert(b, gqa_kv(b))  # budget full of locked blocks: best effort, stores none
    assert (full.stored_tokens, full.evicted.blocks) == (0, 0)
    assert cache.evict(10**9).blocks == 0
    assert cache.match(a).matched_tokens == 2 * BS
    assert cache.stats().bytes_locked == 2 * block_bytes()
    cache.unlock(handle)
    assert cache.insert(b, gqa_kv(b)).stored_tokens == BS  # now the tail of a can go
    assert cache.match(a).matched_tokens == BS


def test_match_lock_keeps_its_prefix_until_unlocked() -> None:
    cache = PrefixCache(2 * block_bytes(), block_size=BS)
    a = [1] * (2 * BS)
    cache.insert(a, gqa_kv(a))
    handle = cache.match(a[:BS], lock=True).handle  # locks only the first block
    assert handle is not None
    assert cache.evict(10**9) == (1, block_bytes())
    assert cache.match(a).matched_tokens == BS
    cache.unlock(handle)
    assert cache.evict(10**9) == (1, block_bytes())
    assert cache.stats().bytes_used == 0


def test_zero_budget_caches_nothing() -> None:
    cache = PrefixCache(0, block_size=BS)
    a = list(range(8))
    assert cache.insert(a, gqa_kv(a)).stored_tokens == 0
    assert cache.match(a).matched_tokens == 0


# -- FORGET purge -------------------------------------------------------------------------


def test_purge_drops_block_containing_start_and_all_descendants() -> None:
    cache = big_cache()
    t = list(range(4 * BS))
    u = t[: 3 * BS] + [77] * BS  # branches from t after its third block
    cache.insert(t, gqa_kv(t))
    cache.insert(u, gqa_kv(u))
    res = cache.purge(t, start=BS + 1)
    assert sorted((b.start, b.end) for b in res.dropped) == [
        (BS, 2 * BS), (2 * BS, 3 * BS), (3 * BS, 4 * BS), (3 * BS, 4 * BS)
    ]  # fmt: skip
    assert res.kept == () and res.dropped_bytes == 4 * block_bytes()
    assert cache.match(t).matched_tokens == BS and cache.match(u).matched_tokens == BS
    s = cache.stats()
    assert (s.blocks, s.bytes_used, s.purged_blocks) == (1, block_bytes(), 4)


def test_purge_at_block_boundary_keeps_the_block_before() -> None:
    cache = big_cache()
    t = list(range(3 * BS))
    cache.insert(t, gqa_kv(t))
    assert len(cache.purge(t, start=BS).dropped) == 2
    assert cache.match(t).matched_tokens == BS


def test_purge_drops_siblings_that_hold_the_forgotten_token() -> None:
    cache = big_cache()
    base = [9] * BS
    t = [*base, 1, 2, 3, 4]
    same_at_start = [*base, 1, 2, 8, 8]  # agrees with t through position BS + 1
    differs_at_start = [*base, 1, 5, 3, 4]  # differs exactly at position BS + 1
    for seq in (t, same_at_start, differs_at_start):
        cache.insert(seq, gqa_kv(seq))
    res = cache.purge(t, start=BS + 1)
    assert len(res.dropped) == 2
    assert cache.match(same_at_start).matched_tokens == BS
    assert cache.match(differs_at_start).matched_tokens == 2 * BS


def test_purge_dooms_blocks_another_session_references_and_frees_them_at_release() -> None:
    cache = big_cache()
    t = list(range(3 * BS))
    u = t[: 2 * BS] + [55] * BS
    cache.insert(t, gqa_kv(t))
    other = cache.insert(u, gqa_kv(u), lock=True).handle  # session B holds u
    assert other is not None
    res = cache.purge(t, start=BS)
    # u's blocks from the one holding `start` onward are derived from the span: B still
    # references them, so they are doomed (listed, children first); t's own tail is dropped.
    assert [(b.start, b.end, b.refcount) for b in res.kept] == [
        (2 * BS, 3 * BS, 1),
        (BS, 2 * BS, 1),
    ]
    assert [(b.start, b.end) for b in res.dropped] == [(2 * BS, 3 * BS)]
    # Nothing derived from the span is matchable any more, B's hold notwithstanding...
    assert cache.match(u).matched_tokens == BS
    assert cache.match(t).matched_tokens == BS
    assert cache.stats().blocks == 3  # ...though B's two blocks stay allocated while held
    cache.unlock(other)  # B is deleted: its doomed blocks are freed, not left reusable
    assert cache.stats().blocks == 1 and cache.stats().bytes_locked == 0
    assert cache.purge(t, start=BS) == ((), ())


def test_purge_releases_the_callers_own_handle_first() -> None:
    cache = big_cache()
    t = list(range(3 * BS))
    own = cache.insert(t, gqa_kv(t), lock=True).handle
    assert own is not None
    res = cache.purge(t, start=2, release=own)
    assert len(res.dropped) == 3 and res.kept == ()
    assert cache.stats().blocks == 0
    with pytest.raises(StaleHandleError):
        cache.unlock(own)


def test_purge_of_uncached_prefix_drops_nothing() -> None:
    cache = big_cache()
    t = list(range(3 * BS))
    cache.insert(t, gqa_kv(t))
    assert cache.purge([50, *t[1:]], start=2 * BS) == ((), ())
    assert cache.stats().blocks == 3


# -- typed errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{"budget_bytes": -1}, {"budget_bytes": 10, "block_size": 0}, {"budget_bytes": 1.5}]
)
def test_bad_config_is_a_typed_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidConfigError):
        PrefixCache(**kwargs)


def test_mismatched_layer_count_is_a_typed_error_and_changes_nothing() -> None:
    cache = big_cache()
    a = list(range(8))
    cache.insert(a, gqa_kv(a, layers=2))
    before = cache.stats()
    with pytest.raises(KVLayoutError, match="2 layers, got 3"):
        cache.insert([1] * 8, gqa_kv([1] * 8, layers=3))
    with pytest.raises(KVLayoutError, match="layer 0"):
        cache.insert([1] * 8, gqa_kv([1] * 8, heads=4))
    assert cache.stats() == before


def test_token_count_must_match_tensor_length() -> None:
    cache = big_cache()
    with pytest.raises(TokenError, match="8 positions"):
        cache.insert(list(range(9)), gqa_kv(list(range(8))))
    assert cache.stats().blocks == 0


def test_other_bad_inputs_are_typed_errors() -> None:
    cache = big_cache()
    a = list(range(8))
    ragged = (gqa_kv(a)[0], gqa_kv(a[:4])[1])
    with pytest.raises(KVLayoutError, match="one length"):
        cache.insert(a, ragged)
    with pytest.raises(KVLayoutError, match="out of range"):
        PrefixCache(100, seq_dim=5).insert(a, gqa_kv(a))
    with pytest.raises(TokenError):
        floats: Any = [1.5, 2.0]
        cache.match(floats)
    with pytest.raises(TokenError):
        cache.purge(a, start=8)
    with pytest.raises(PrefixCacheError):
        cache.evict(-1)
    handle = cache.match(a, lock=True).handle
    assert handle is not None
    cache.unlock(handle)
    with pytest.raises(StaleHandleError):
        cache.unlock(handle)
    assert issubclass(PrefixCacheError, ValueError)


def test_tensor_tokens_are_accepted() -> None:
    cache = big_cache()
    a = list(range(8))
    tensor_tokens: Any = torch.tensor(a)
    cache.insert(tensor_tokens, gqa_kv(a))
    assert cache.match(a).matched_tokens == 8


# -- invariants: threads and a property test against a naive model ------------------------


def trie_nodes(cache: PrefixCache) -> list[TrieNode]:
    """White-box walk of the trie (private on purpose: the tests check its invariants)."""
    out, stack = [], [c for r in cache._trie._roots.values() for c in r.children.values()]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def prefix_of(node: TrieNode) -> tuple[int, ...]:
    parts: list[tuple[int, ...]] = []
    cur: TrieNode | None = node
    while cur is not None and cur.key:
        parts.append(cur.key)
        cur = cur.parent
    return tuple(t for key in reversed(parts) for t in key)


def all_nodes(cache: PrefixCache) -> list[TrieNode]:
    """Attached nodes plus the doomed ones still held (reachable only from handles)."""
    seen = {id(n): n for n in trie_nodes(cache)}
    for node in cache._handles.values():
        cur: TrieNode | None = node
        while cur is not None and cur.parent is not None:
            seen.setdefault(id(cur), cur)
            cur = cur.parent
    return list(seen.values())


def _on_path(held: TrieNode, node: TrieNode) -> bool:
    cur: TrieNode | None = held
    while cur is not None:
        if cur is node:
            return True
        cur = cur.parent
    return False


def check_invariants(cache: PrefixCache) -> None:
    attached = {id(n) for n in trie_nodes(cache)}
    nodes = all_nodes(cache)
    s = cache.stats()
    assert s.blocks == len(nodes)
    assert s.bytes_used == sum(n.nbytes for n in nodes) <= s.budget_bytes
    assert s.bytes_locked == sum(n.nbytes for n in nodes if n.refcount > 0)
    held = list(cache._handles.values())
    for n in nodes:
        assert n.refcount == sum(_on_path(h, n) for h in held)
        assert n.doomed == (id(n) not in attached)
        assert not n.doomed or n.refcount > 0  # a doomed node lives only while held
        assert n.start == len(prefix_of(n)) - BS and n.nbytes == block_bytes()


def test_concurrent_sessions_keep_accounting_consistent() -> None:
    cache = PrefixCache(6 * block_bytes(), block_size=BS)
    errors: list[BaseException] = []

    def session(seed: int) -> None:
        try:
            for i in range(30):
                seq = [seed % 2, *([(seed + i) % 3] * (2 * BS - 1))]
                handle = cache.insert(seq, gqa_kv(seq), lock=True).handle
                res = cache.match(seq)
                if res.matched_tokens:
                    assert_kv_equal(res.kv, take(gqa_kv(seq), res.matched_tokens))
                if i % 7 == 0:
                    cache.purge(seq, start=BS)
                assert handle is not None
                cache.unlock(handle)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=session, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    check_invariants(cache)
    assert cache.stats().bytes_locked == 0


class NaiveCache:
    """The spec as a dict of block-aligned prefixes, with the same LRU and budget rules."""

    def __init__(self, budget: int) -> None:
        self.budget, self.size = budget, block_bytes()
        self.stamp: dict[tuple[int, ...], int] = {}
        self.handles: dict[int, tuple[int, ...]] = {}
        self.doomed_from: dict[int, int] = {}  # handle -> its path is doomed past this
        self.doomed: list[set[int]] = []  # per doomed block: the handles that hold it
        self.clock = 0

    def attached(self, hid: int, length: int) -> bool:
        return length <= self.doomed_from.get(hid, length)

    def refs(self, p: tuple[int, ...], extra: tuple[int, ...] | None = None) -> int:
        held = sum(
            h[: len(p)] == p and self.attached(hid, len(p)) for hid, h in self.handles.items()
        )
        return held + (extra is not None and extra[: len(p)] == p)

    def alive_doomed(self) -> int:
        return sum(1 for holders in self.doomed if holders & self.handles.keys())

    def longest(self, toks: tuple[int, ...]) -> int:
        n = 0
        while n + BS <= len(toks) and toks[: n + BS] in self.stamp:
            n += BS
        return n

    def touch(self, toks: tuple[int, ...], n: int) -> None:
        self.clock += 1
        for k in range(BS, n + 1, BS):
            self.stamp[toks[:k]] = self.clock

    def evict(self, need: int, protect: tuple[int, ...] | None = None) -> int:
        freed = 0
        while freed < need:
            leaves = [
                p
                for p in self.stamp
                if self.refs(p, protect) == 0
                and not any(len(q) == len(p) + BS and q[: len(p)] == p for q in self.stamp)
            ]
            if not leaves:
                break
            del self.stamp[min(leaves, key=self.stamp.__getitem__)]
            freed += self.size
        return freed // self.size

    def insert(self, toks: tuple[int, ...]) -> tuple[int, int]:
        n = self.longest(toks)
        self.touch(toks, n)
        cur = n
        while cur + BS <= len(toks):
            locked = sum(self.size for p in self.stamp if self.refs(p, toks[:cur]))
            locked += self.alive_doomed() * self.size
            if locked + self.size > self.budget:
                break
            used = (len(self.stamp) + self.alive_doomed()) * self.size
            if used + self.size > self.budget:
                self.evict(used + self.size - self.budget, toks[:cur])
            cur += BS
            self.stamp[toks[:cur]] = self.clock
        return n, cur

    def purge(self, toks: tuple[int, ...], start: int) -> int:
        hit = [p for p in self.stamp if len(p) > start and p[: start + 1] == toks[: start + 1]]
        gone = 0
        holders_of = {
            p: {
                hid
                for hid, h in self.handles.items()
                if h[: len(p)] == p and self.attached(hid, len(p))
            }
            for p in hit
        }
        for p in hit:
            del self.stamp[p]
            if holders_of[p]:
                self.doomed.append(holders_of[p])  # held: detached, freed at release
            else:
                gone += 1
        for hid in set().union(*holders_of.values()) if hit else ():
            self.doomed_from[hid] = min(self.doomed_from.get(hid, start), start)
        return gone


# Sequences built from a small pool of blocks, so that prefixes are often shared and
# sibling blocks often agree on their first tokens; plus a partial tail.
BLOCK_POOL = [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 1, 1), (1, 1, 1, 1)]
SEQS = st.tuples(
    st.lists(st.sampled_from(BLOCK_POOL), max_size=4),
    st.lists(st.integers(0, 1), max_size=BS - 1),
).map(lambda p: tuple(t for block in p[0] for t in block) + tuple(p[1]))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), SEQS, st.booleans()),
        st.tuples(st.just("match"), SEQS, st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 99)),
        st.tuples(st.just("purge"), SEQS, st.integers(0, 99), st.integers(-1, 99)),
        st.tuples(st.just("evict"), st.integers(0, 3 * block_bytes())),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(budget_blocks=st.sampled_from([0, 1, 3, 5, 1000]), ops=OPS)
def test_random_operations_agree_with_naive_model(
    budget_blocks: int, ops: list[tuple[Any, ...]]
) -> None:
    cache = PrefixCache(budget_blocks * block_bytes(), block_size=BS)
    model = NaiveCache(budget_blocks * block_bytes())
    handles: dict[int, LockHandle] = {}
    for op in ops:
        if op[0] == "insert":
            _, toks, lock = op
            res = cache.insert(toks, gqa_kv(toks), lock=lock)
            assert (res.cached_tokens, res.stored_tokens) == model.insert(toks)
            if res.handle is not None:
                handles[res.handle.id] = res.handle
                model.handles[res.handle.id] = toks[: res.stored_tokens]
        elif op[0] == "match":
            _, toks, lock = op
            m = cache.match(toks, lock=lock)
            n = model.longest(toks)
            model.touch(toks, n)
            assert m.matched_tokens == n
            if n:
                assert_kv_equal(m.kv, take(gqa_kv(toks), n))
            if m.handle is not None:
                handles[m.handle.id] = m.handle
                model.handles[m.handle.id] = toks[:n]
        elif op[0] == "unlock" and handles:
            hid = sorted(handles)[op[1] % len(handles)]
            cache.unlock(handles.pop(hid))
            del model.handles[hid]
        elif op[0] == "purge" and op[1]:
            _, toks, start, pick = op
            start %= len(toks)
            release = None
            if pick >= 0 and handles:
                hid = sorted(handles)[pick % len(handles)]
                release = handles.pop(hid)
                del model.handles[hid]
            assert len(cache.purge(toks, start, release=release).dropped) == model.purge(
                toks, start
            )
        elif op[0] == "evict":
            need = op[1]
            assert cache.evict(need).blocks == model.evict(need)
        assert {prefix_of(n) for n in trie_nodes(cache)} == set(model.stamp)
        check_invariants(cache)


def test_salts_hold_roots_only_while_they_hold_blocks() -> None:
    """Clients choose ``cache_salt``s: a lookup, a miss, a purge or an insert that fits
    nothing must not leave a root behind, so the trie's roots stay bounded by the salts
    that hold KV (a fuzz run sends a new salt per request)."""
    cache = PrefixCache(budget_bytes=2 * block_bytes(), block_size=BS)  # one sequence
    trie = cache._trie
    toks = list(range(1, 9))
    for i in range(50):
        salt = f"s{i}"
        assert cache.match(toks, salt=salt, lock=True).matched_tokens == 0
        cache.purge(toks, 0, salt=salt)
    assert trie.salts == 1  # the public root only
    cache.insert(toks, gqa_kv(toks), salt="kept")
    assert trie.salts == 2 and cache.match(toks, salt="kept").matched_tokens == 8
    cache.purge(toks, 0, salt="kept")
    assert trie.salts == 1 and cache.match(toks, salt="kept").matched_tokens == 0
    cache.insert(toks, gqa_kv(toks), salt="a")
    cache.insert(toks, gqa_kv(toks), salt="b")  # evicts a's blocks to fit
    assert cache.match(toks, salt="a").matched_tokens == 0
    assert trie.salts == 2  # a's root went with its last block
