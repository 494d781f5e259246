"""A generation decoding into room its session's prefill reserved, instead of a copy.

Every figure is compared with the copy path (the same session prefilled without room): the
tokens and the KV must be bitwise the same, and what the session shares with a fork or a
pending generation must never be written under it. Tiny random models (GQA Llama, MLA).
"""

from __future__ import annotations

import pytest
import torch

from leyline.core.turns import SamplingParams
from leyline.engine.engine import Engine
from leyline.engine.kv.buffer_views import capacity
from leyline.engine.models import build_tiny_mla
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode

from ._helpers import kv_bitwise_equal, random_tokens, snapshot

GREEDY = SamplingParams(max_new_tokens=6, stop_token_ids=(-1,))


@pytest.fixture(params=["llama", "mla"])
def engine(request: pytest.FixtureRequest, llama_engine: Engine) -> Engine:
    return llama_engine if request.param == "llama" else Engine(build_tiny_mla("v2"))


def _session(engine: Engine, reserve: int, seed: int = 1, n: int = 40) -> SessionCache:
    session = SessionCache(engine)
    session.prefill(random_tokens(n, engine.vocab_size, seed), reserve=reserve)
    return session


def _storage(session: SessionCache) -> list[int]:
    return [t.untyped_storage().data_ptr() for layer in session.kv for t in layer]


def test_a_prefill_reserves_room_past_the_sequence(engine: Engine) -> None:
    roomy, tight = _session(engine, 16), _session(engine, 0)
    assert {capacity(t) for layer in roomy.kv for t in layer} == {40 + 16}
    assert {capacity(t) for layer in tight.kv for t in layer} == {40}
    assert kv_bitwise_equal(roomy.kv, tight.kv)
    assert torch.equal(roomy.next_token_logits(), tight.next_token_logits())
    with pytest.raises(ValueError, match="reserve"):
        engine.forward((), [5, 6], reserve=-1)
    cap = engine.limits.max_session_tokens
    assert cap is not None
    capped = _session(engine, 10 * cap)  # never room past what a generation may reach
    assert {capacity(t) for layer in capped.kv for t in layer} == {cap}


def test_the_generation_decodes_in_the_reserved_room_as_the_copy_would(engine: Engine) -> None:
    roomy, tight = _session(engine, GREEDY.max_new_tokens), _session(engine, 0)
    storage = _storage(roomy)
    pending = roomy.begin_generation(GREEDY)
    assert pending.decoder.in_place and not roomy.state.owns_kv  # lent while it runs
    copied = tight.begin_generation(GREEDY)
    assert not copied.decoder.in_place
    got, want = roomy.generate_pending(pending), tight.generate_pending(copied)
    assert got.tokens == want.tokens and roomy.tokens == tight.tokens
    assert kv_bitwise_equal(roomy.kv, tight.kv)
    assert _storage(roomy) == storage  # no copy of the cache was made
    assert roomy.state.owns_kv  # nobody else holds it: in-place edits may move it again
    roomy.apply_edits([Edit(5, 12, (), Mode.amortize)], want_logits=True)
    tight.apply_edits([Edit(5, 12, (), Mode.amortize)], want_logits=True)
    assert torch.equal(roomy.next_token_logits(), tight.next_token_logits())


def test_too_little_room_falls_back_to_a_copy(engine: Engine) -> None:
    session = _session(engine, 2)
    before = _storage(session)
    pending = session.begin_generation(GREEDY)  # 6 tokens: 5 positions needed, 2 free
    assert not pending.decoder.in_place and session.state.owns_kv
    session.generate_pending(pending)
    assert _storage(session) != before


def test_a_fork_during_the_generation_keeps_its_kv_and_the_session_stops_owning(
    engine: Engine,
) -> None:
    session = _session(engine, GREEDY.max_new_tokens)
    pending = session.begin_generation(GREEDY)
    fork = session.fork()
    held = (fork.tokens, snapshot(fork.kv))
    session.generate_pending(pending)  # a fork since begin still lets it commit
    assert not session.state.owns_kv  # the fork reads the same buffers
    assert (fork.tokens, fork.state.owns_kv) == (held[0], False)
    assert kv_bitwise_equal(fork.kv, held[1])
    session.apply_edits([Edit(3, 9, (), Mode.amortize)])  # by copy: the fork is untouched
    assert kv_bitwise_equal(fork.kv, held[1])


def test_an_edit_while_the_generation_is_pending_is_a_copy_and_wins(engine: Engine) -> None:
    """The edit may not move the KV the decoder writes past: the session lends its buffers
    (owns_kv false), so the edit copies; the generation then cannot commit."""
    session, reference = _session(engine, GREEDY.max_new_tokens), _session(engine, 0)
    reference.fork()  # shared: its edit takes the copy path too
    pending = session.begin_generation(GREEDY)
    storage = _storage(session)
    session.apply_edits([Edit(4, 10, (7,), Mode.amortize)], want_logits=True)
    reference.apply_edits([Edit(4, 10, (7,), Mode.amortize)], want_logits=True)
    assert _storage(session) != storage
    with pytest.raises(RuntimeError, match="changed"):
        session.generate_pending(pending)
    assert session.tokens == reference.tokens and kv_bitwise_equal(session.kv, reference.kv)


def test_an_abandoned_generation_leaves_the_session_as_it_was(engine: Engine) -> None:
    session, reference = _session(engine, GREEDY.max_new_tokens), _session(engine, 0)
    held = (session.tokens, session.revision, snapshot(session.kv))
    pending = session.begin_generation(GREEDY)
    decoder = pending.decoder
    while decoder.choose():  # stepped by hand, never committed
        logits = engine.forward_into(decoder.buffers, decoder.length, [decoder.pending])
        decoder.advance(logits)
    assert (session.tokens, session.revision) == held[:2]
    assert kv_bitwise_equal(session.kv, held[2])
    again, want = session.generate(GREEDY), reference.generate(GREEDY)
    assert again.tokens == want.tokens and kv_bitwise_equal(session.kv, reference.kv)
