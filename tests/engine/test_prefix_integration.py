"""The engine with the shared prefix cache: reuse, exact-only publication, FORGET purge, locks."""

from __future__ import annotations

from leyline.engine.engine import Engine
from leyline.engine.kv.prefix_cache import PrefixCache
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.envelope import Path

from ._helpers import random_tokens, rel_err, tiny_llama

BS = 4


def _engine(budget: int = 10**8) -> Engine:
    return Engine(tiny_llama(), prefix_cache=PrefixCache(budget, block_size=BS))


def _close_to_fresh(engine: Engine, session) -> None:
    fresh_kv, fresh_logits = engine.forward((), session.tokens)
    assert rel_err(session.next_token_logits(), fresh_logits) <= 1e-5
    for got, want in zip(session.kv, fresh_kv, strict=True):
        assert rel_err(got[0], want[0]) <= 1e-5 and rel_err(got[1], want[1]) <= 1e-5


def test_a_new_session_reuses_a_shared_prefix() -> None:
    engine = _engine()
    t = random_tokens(40, engine.vocab_size, seed=1)
    SessionCache(engine).prefill(t)
    b = SessionCache(engine)
    report = b.prefill(t[:30] + random_tokens(10, engine.vocab_size, seed=2))
    assert report.path is Path.prefix_hit and report.reused_tokens == 28
    assert report.prefilled_tokens == 12
    _close_to_fresh(engine, b)


def test_only_the_exact_prefix_of_an_amortized_splice_is_shared() -> None:
    engine = _engine()
    a = SessionCache(engine)
    a.prefill(random_tokens(40, engine.vocab_size, seed=3))
    a.apply_edits([Edit(10, 20, (5, 6), Mode.amortize)])  # exact: [0, 12); the rest amortized
    c = SessionCache(engine)
    report = c.prefill(a.tokens)
    assert report.reused_tokens == 12  # not the amortized downstream
    _close_to_fresh(engine, c)


def test_forget_leaves_nothing_derived_from_the_span_reusable() -> None:
    engine = _engine()
    cache = engine.prefix_cache
    assert cache is not None
    t = random_tokens(40, engine.vocab_size, seed=4)
    a, b = SessionCache(engine), SessionCache(engine)
    a.prefill(t)
    other = t[:26] + random_tokens(8, engine.vocab_size, seed=5)
    b.prefill(other)  # shares t[:26] with a: blocks up to 24 are b's too
    a.apply_edits([Edit(25, 30, (), Mode.forget)])
    assert cache.match(t).matched_tokens == 24  # a's old blocks from 24 on are gone
    # b's blocks from 24 on attended to t[25] too: b keeps its own KV (its session state),
    # but they are no longer shared, and b's delete frees them instead of leaving them.
    assert cache.match(other).matched_tokens == 24
    assert cache.match(a.tokens).matched_tokens == 32  # a's new sequence is shared
    assert cache.stats().purged_blocks >= 4
    held = cache.stats().blocks
    b.release()
    assert cache.stats().blocks == held - 2
    c = SessionCache(engine)
    assert c.prefill(t).reused_tokens == 24  # a later request with the secret reuses none of it


def test_held_blocks_are_not_evicted_until_released() -> None:
    engine = _engine()
    cache = engine.prefix_cache
    assert cache is not None
    a = SessionCache(engine)
    a.prefill(random_tokens(40, engine.vocab_size, seed=6))
    cache.evict(10**12)
    assert cache.match(a.tokens).matched_tokens == 40
    a.release()
    cache.evict(10**12)
    assert cache.match(a.tokens).matched_tokens == 0


def test_the_budget_bounds_what_is_shared() -> None:
    block_bytes = 2 * 2 * (1 * 2 * BS * 32) * 4  # layers x (k, v) x [1, heads, BS, dim] fp32
    engine = _engine(budget=5 * block_bytes)
    s = SessionCache(engine)
    s.prefill(random_tokens(40, engine.vocab_size, seed=7))
    stats = engine.prefix_cache.stats()  # type: ignore[union-attr]
    assert stats.bytes_used <= 5 * block_bytes and stats.blocks == 5
    _close_to_fresh(engine, s)


def _secret_session(engine: Engine) -> tuple[SessionCache, list[int], range]:
    """A session holding a prefix, a secret span at [16, 24), and a tail; all published."""
    tokens = random_tokens(40, engine.vocab_size, seed=11)
    session = SessionCache(engine)
    session.prefill(tokens)
    return session, tokens, range(16, 24)


def _reuse(engine: Engine, tokens: list[int]) -> int:
    probe = SessionCache(engine)
    try:
        return probe.prefill(tokens).reused_tokens
    finally:
        probe.release()


def test_forget_purges_what_an_earlier_revision_published_behind_another_prefix() -> None:
    engine = _engine()
    a, original, secret = _secret_session(engine)
    a.apply_edits([Edit(2, 4, (7, 7, 7), Mode.amortize)])  # the secret now starts at 17
    a.apply_edits([Edit(secret.start + 1, secret.stop + 1, (), Mode.forget)])
    # Revision 1 published the original tokens: nothing from the secret on may be reused.
    assert _reuse(engine, original) <= secret.start


def test_forget_purges_what_a_client_resent_with_an_edit_before_the_span() -> None:
    engine = _engine()
    a, original, secret = _secret_session(engine)
    edited = [*original[:2], 7, 7, 7, *original[4:]]  # an edited message before the secret
    a.prefill(edited)  # re-prefilled from 2; published again, secret at [17, 25)
    a.apply_edits([Edit(secret.start + 1, secret.stop + 1, (), Mode.forget)])
    assert _reuse(engine, original) <= secret.start
    assert _reuse(engine, edited) <= secret.start + 1


def test_forget_purges_what_a_client_resent_with_an_edit_and_a_new_turn() -> None:
    engine = _engine()
    a, original, secret = _secret_session(engine)
    more = random_tokens(8, engine.vocab_size, seed=12)
    a.prefill([*original[:2], 7, 7, 7, *original[4:], *more])  # edited, and a turn appended
    a.apply_edits([Edit(secret.start + 1, secret.stop + 1, (), Mode.forget)])
    assert _reuse(engine, original) <= secret.start
