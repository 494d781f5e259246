"""``VllmBackend`` through the session core, over a stand-in engine (``_fake_engine``): which
requests a directive runs, in which namespace, with which order, and what it reports."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from leyline.core.errors import SpliceUnsupportedError
from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT, SessionStore
from leyline.core.turns import SamplingParams, Turn
from leyline.protocol import ErrorCode, FallbackReason, LeylineError, Limits, Verb
from leyline.protocol.resources import ApplyDirectives, SessionCreate, SkillCreate
from leyline.vllm.backend import VllmBackend, VllmSession

from ._fake_engine import FakeEngine

BLOCK = 4
TOKENS = list(range(100, 122))  # 22 tokens: 5 full blocks and a partial one


class _Chars:
    """A character-level tokenizer (the directives' default replacement is text)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _stack(
    refusal: SpliceUnsupportedError | None = None,
) -> tuple[SessionService[VllmSession], VllmBackend, FakeEngine]:
    engine = FakeEngine(BLOCK)
    backend = VllmBackend(
        engine, _Chars(), limits=Limits(), vocab_size=1000, block_size=BLOCK, refusal=refusal
    )
    return SessionService(backend, SessionStore(backend)), backend, engine


def _session(service: SessionService[VllmSession], tokens: list[int]) -> str:
    info = _run(service.create(DEFAULT_TENANT, SessionCreate(tokens=tokens)))
    return str(info.session)


def _apply(service: SessionService[VllmSession], session: str, *directives: Any) -> Any:
    body = ApplyDirectives(base_revision=1, directives=list(directives))
    return _run(service.apply(DEFAULT_TENANT, session, body))


def _splice(start: int, end: int, replacement: list[int]) -> dict[str, Any]:
    return {"verb": "splice", "span": {"start": start, "end": end}, "replacement": replacement}


def _handle(service: SessionService[VllmSession], session: str) -> VllmSession:
    return service.store.get(DEFAULT_TENANT, session).handle


def test_a_cut_is_loaded_rotated_into_a_private_namespace() -> None:
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    reply = _apply(service, session, _splice(6, 10, []))
    new = TOKENS[:6] + TOKENS[10:]
    handle = _handle(service, session)
    assert handle.private_salt is not None and handle.private_salt.startswith("leyline-")
    build = engine.requests[-1]
    assert len(engine.requests) == 2 and build.tokens == tuple(new)
    assert build.salt == handle.private_salt
    # The prefix copied bitwise from the shared namespace, then the kept rows rotated by -4
    # while their source block is cached (old positions < 20); the rest computed.
    assert build.kv[:6] == [f"loaded None {p} 0" for p in range(6)]
    assert build.kv[6:16] == [f"loaded None {p + 4} -4" for p in range(6, 16)]
    assert build.kv[16:] == ["computed"] * 2
    assert reply.path == "splice" and reply.fallback_reason is None
    assert (reply.reused_tokens, reply.rotated_tokens, reply.prefilled_tokens) == (16, 10, 2)
    # A plain request for the same tokens shares no block with the build.
    assert engine.cached_blocks(None, new) == 1


def test_a_replacement_is_computed_by_a_prefix_rounded_up_to_a_block() -> None:
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    reply = _apply(service, session, _splice(6, 10, [1]))
    new = (*TOKENS[:6], 1, *TOKENS[10:])
    first, whole = engine.requests[1:]
    assert first.tokens == new[:8]  # the run ends at 7: its block ends at 8
    assert first.kv == [f"loaded None {p} 0" for p in range(6)] + ["computed"] * 2
    assert whole.tokens == new and whole.kv[:8] == ["hit"] * 8
    assert whole.kv[8:17] == [f"loaded None {p + 3} -3" for p in range(8, 17)]
    assert whole.kv[17:] == ["computed"] * 2  # old 20, 21: in a block never cached
    assert (reply.reused_tokens, reply.rotated_tokens) == (6 + 9, 9)


def test_the_turn_after_a_build_loads_the_partial_block_again() -> None:
    service, backend, engine = _stack()
    session = _session(service, TOKENS)
    _apply(service, session, _splice(2, 3, [1, 2]))  # 23 tokens: 20..22 never cached
    handle = _handle(service, session)
    new = handle.view.tokens
    assert engine.requests[-1].kv[20] == "loaded None 19 1"  # into the unfinished block
    prompt = (*new, 5, 6)
    turn: Turn[VllmSession] = Turn(
        handle, None, prompt, None, SamplingParams(max_new_tokens=1), lambda t: True, lambda: False
    )
    outcome = _run(backend.run_turn(turn))
    request = engine.requests[-1]
    assert request.salt == handle.private_salt
    assert request.kv[:20] == ["hit"] * 20 and request.kv[20] == "loaded None 19 1"
    assert request.kv[21:] == ["computed"] * 4  # the moved last token (22) recomputed
    assert outcome.prefill.reused_tokens == 21 and handle.tail is None
    assert handle.view.tokens == (*prompt, 7) and handle.computed == len(prompt)


def test_forget_purges_every_namespace_and_reprefills() -> None:
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    _apply(service, session, _splice(6, 10, []))  # private now
    handle = _handle(service, session)
    private, spliced = handle.private_salt, handle.view.tokens
    forget = {"verb": "forget", "span": {"start": 12, "end": 14}}
    body = ApplyDirectives(base_revision=2, directives=[forget])
    reply = _run(service.apply(DEFAULT_TENANT, session, body))
    request = engine.requests[-1]
    assert request.salt == private and request.order is not None
    purged = {(t.salt, t.tokens, t.from_position) for t in request.order.purge}
    assert (private, spliced, 12) in purged and (None, spliced, 12) in purged
    assert (None, tuple(TOKENS), 16) in purged  # the original, where the span came from
    assert engine.cached_blocks(None, TOKENS) == 4  # blocks from 16 on are gone
    assert reply.path == "reprefill" and reply.reused_tokens == 12
    assert request.kv[12:] == ["computed"] * (len(request.tokens) - 12)


def test_without_the_connector_a_splice_is_refused_or_reprefilled() -> None:
    refusal = SpliceUnsupportedError(FallbackReason.unsupported_runtime, "no connector")
    service, backend, engine = _stack(refusal)
    assert backend.capabilities().architectures == []
    session = _session(service, TOKENS)
    strict = {"allow_fallback": False}
    body = ApplyDirectives(base_revision=1, directives=[_splice(6, 10, [])], options=strict)
    with pytest.raises(SpliceUnsupportedError):
        _run(service.apply(DEFAULT_TENANT, session, body))
    assert len(engine.requests) == 1 and _handle(service, session).view.tokens == tuple(TOKENS)
    reply = _apply(service, session, _splice(6, 10, []))
    assert reply.path == "reprefill" and reply.fallback_reason == "unsupported_runtime"
    assert engine.requests[-1].salt is None and engine.requests[-1].order is None


def test_compose_is_not_offered_and_reserved_salts_are_refused() -> None:
    service, backend, _ = _stack()
    assert Verb.compose not in backend.capabilities().verbs
    with pytest.raises(LeylineError) as refused:
        _run(service.create_skill(DEFAULT_TENANT, SkillCreate(tokens=[1, 2])))
    assert refused.value.code is ErrorCode.unsupported_verb
    with pytest.raises(LeylineError) as salted:
        _run(service.create(DEFAULT_TENANT, SessionCreate(tokens=[1], cache_salt="leyline-x")))
    assert salted.value.field == "cache_salt"
