"""``VllmBackend`` through the session core, over a stand-in engine (``_fake_engine``): which
requests a directive runs, in which namespace, with which order, and what it reports."""

from __future__ import annotations

from typing import Any

import pytest

from leyline.core.errors import SpliceUnsupportedError
from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT
from leyline.protocol import ErrorCode, FallbackReason, LeylineError, Verb
from leyline.protocol.resources import ApplyDirectives, SessionCreate, SkillCreate
from leyline.vllm.backend import VllmSession
from leyline.vllm.build import padded

from ._fake_engine import FakeEngine
from ._service import Stack, handle_of, one_token_turn, run, stack

BLOCK = 4
TOKENS = list(range(100, 122))  # 22 tokens: 5 full blocks and a partial one


class _Chars:
    """A character-level tokenizer (the directives' default replacement is text)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _stack(refusal: SpliceUnsupportedError | None = None) -> Stack:
    return stack(FakeEngine(BLOCK), _Chars(), refusal=refusal)


def _session(service: SessionService[VllmSession], tokens: list[int]) -> str:
    info = run(service.create(DEFAULT_TENANT, SessionCreate(tokens=tokens)))
    return str(info.session)


def _apply(service: SessionService[VllmSession], session: str, *directives: Any) -> Any:
    body = ApplyDirectives(base_revision=1, directives=list(directives))
    return run(service.apply(DEFAULT_TENANT, session, body))


def _splice(start: int, end: int, replacement: list[int]) -> dict[str, Any]:
    return {"verb": "splice", "span": {"start": start, "end": end}, "replacement": replacement}


def test_a_cut_loads_every_kept_row_rotated_into_a_private_namespace() -> None:
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    reply = _apply(service, session, _splice(6, 10, []))
    new = TOKENS[:6] + TOKENS[10:]
    handle = handle_of(service, session)
    assert handle.private_salt is not None and handle.private_salt.startswith("leyline-")
    # Old row 20 is kept (new 16) but sits in the old partial block: the old sequence plus
    # filler is cached whole first, in its own namespace, computing only that block.
    old, build = engine.requests[1:]
    assert old.tokens == padded(TOKENS, BLOCK) and old.salt is None
    assert old.kv == ["hit"] * 20 + ["computed"] * 4
    assert build.tokens == padded(new, BLOCK) and build.salt == handle.private_salt
    # The prefix copied bitwise from the shared namespace, every kept row rotated by -4, the
    # new last token computed in its new context (and the filler after it).
    assert build.kv[:6] == [f"loaded None {p} 0" for p in range(6)]
    assert build.kv[6:17] == [f"loaded None {p + 4} -4" for p in range(6, 17)]
    assert build.kv[17:] == ["computed"] * 3
    assert reply.path == "splice" and reply.fallback_reason is None
    assert (reply.reused_tokens, reply.rotated_tokens, reply.prefilled_tokens) == (17, 11, 1)
    # A plain request for the same tokens shares no block with the build.
    assert engine.cached_blocks(None, new) == 1


def test_a_replacement_is_computed_by_its_own_request_then_loaded() -> None:
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    reply = _apply(service, session, _splice(6, 10, [1]))
    new = (*TOKENS[:6], 1, *TOKENS[10:])
    first, whole = engine.requests[2:]
    assert first.tokens == padded(new[:7], BLOCK)  # the run is new[6]; filler to 8
    assert first.kv == [f"loaded None {p} 0" for p in range(6)] + ["computed"] * 2
    salt = handle_of(service, session).private_salt
    assert whole.tokens == padded(new, BLOCK) and whole.kv[:4] == ["hit"] * 4
    assert whole.kv[4:7] == [f"loaded {salt} {p} 0" for p in range(4, 7)]  # with the run
    assert whole.kv[7:18] == [f"loaded None {p + 3} -3" for p in range(7, 18)]
    assert whole.kv[18:] == ["computed"] * 2  # the new last token, then filler
    assert reply.fallback_reason is None
    assert (reply.reused_tokens, reply.prefilled_tokens, reply.rotated_tokens) == (17, 2, 11)


def test_later_requests_load_the_partial_block_from_the_build() -> None:
    """vLLM caches whole blocks only: the rows a build loaded into the last partial block
    are loaded again by every turn while that block is partial, never recomputed."""
    service, backend, engine = _stack()
    session = _session(service, TOKENS)
    _apply(service, session, _splice(2, 3, [1, 2]))  # 23 tokens
    handle = handle_of(service, session)
    new, salt = handle.view.tokens, handle.private_salt
    built = engine.requests[-1]
    assert built.kv[4:22] == [f"loaded None {p - 1} 1" for p in range(4, 22)]
    one_token_turn(backend, handle, new)  # the same tokens: the last one is computed again
    first = engine.requests[-1]
    assert first.kv[:20] == ["hit"] * 20
    assert first.kv[20:] == [f"loaded {salt} 20 0", f"loaded {salt} 21 0", "computed"]
    outcome = one_token_turn(backend, handle, (*handle.view.tokens, 8))  # 23 + 1 generated + 1
    second = engine.requests[-1]
    assert second.kv[20:23] == [f"loaded {salt} {p} 0" for p in range(20, 23)]
    assert second.kv[23:] == ["computed"] * 2
    assert outcome.prefill.reused_tokens == 23 and handle.computed == 25


def test_a_second_splice_reads_the_old_partial_block_through_the_recipe() -> None:
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    _apply(service, session, _splice(6, 10, []))  # 18 tokens, private
    handle = handle_of(service, session)
    salt, first_build = handle.private_salt, engine.requests[-1]
    body = ApplyDirectives(base_revision=2, directives=[_splice(2, 4, [])])
    reply = run(service.apply(DEFAULT_TENANT, session, body))
    old, build = engine.requests[-2:]
    # The old sequence's partial block (16, 17) is cached whole: its rows loaded as the
    # first build left them, the filler computed.
    assert old.tokens == first_build.tokens and old.salt == salt
    assert old.kv[16:18] == [f"loaded {salt} 16 0", f"loaded {salt} 17 0"]
    assert build.kv[2:15] == [f"loaded {salt} {p + 2} -2" for p in range(2, 15)]
    assert reply.fallback_reason is None and reply.rotated_tokens == 13


def test_forget_purges_every_namespace_and_reprefills() -> None:
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    _apply(service, session, _splice(6, 10, []))  # private now
    handle = handle_of(service, session)
    private, spliced = handle.private_salt, handle.view.tokens
    forget = {"verb": "forget", "span": {"start": 12, "end": 14}}
    body = ApplyDirectives(base_revision=2, directives=[forget])
    reply = run(service.apply(DEFAULT_TENANT, session, body))
    request = engine.requests[-1]
    assert request.salt == private and request.order is not None
    purged = {(t.salt, t.tokens, t.from_position) for t in request.order.purge}
    assert (private, spliced, 12) in purged and (None, spliced, 12) in purged
    # The original (cached whole by the splice, filler and all), where the span came from.
    assert (None, padded(TOKENS, BLOCK), 16) in purged
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
        run(service.apply(DEFAULT_TENANT, session, body))
    assert len(engine.requests) == 1 and handle_of(service, session).view.tokens == tuple(TOKENS)
    reply = _apply(service, session, _splice(6, 10, []))
    assert reply.path == "reprefill" and reply.fallback_reason == "unsupported_runtime"
    assert engine.requests[-1].salt is None and engine.requests[-1].order is None


def test_without_the_connector_compose_is_not_offered_and_reserved_salts_are_refused() -> None:
    refusal = SpliceUnsupportedError(FallbackReason.unsupported_runtime, "no connector")
    service, backend, _ = _stack(refusal)
    assert Verb.compose not in backend.capabilities().verbs
    with pytest.raises(LeylineError) as refused:
        run(service.create_skill(DEFAULT_TENANT, SkillCreate(tokens=[1, 2])))
    assert refused.value.code is ErrorCode.unsupported_verb
    with pytest.raises(LeylineError) as salted:
        run(service.create(DEFAULT_TENANT, SessionCreate(tokens=[1], cache_salt="leyline-x")))
    assert salted.value.field == "cache_salt"


def test_a_splice_before_a_forget_says_it_was_re_prefilled() -> None:
    """Protocol 4, rule 6 keeps a splice's downstream rows up to a later forget; vLLM
    re-prefills the batch from its first change, and says so (or refuses without
    fallback). A forget first needs no fallback: everything after it is recomputed."""
    forget = {"verb": "forget", "span": {"start": 12, "end": 14}}
    service, _, _ = _stack()
    reply = _apply(service, _session(service, TOKENS), _splice(2, 4, []), forget)
    assert reply.path == "reprefill" and reply.fallback_reason == "unsupported_runtime"
    early = {"verb": "forget", "span": {"start": 2, "end": 4}}
    reply = _apply(service, _session(service, TOKENS), early, _splice(12, 14, []))
    assert reply.path == "reprefill" and reply.fallback_reason is None
    session = _session(service, TOKENS)
    body = ApplyDirectives(
        base_revision=1, directives=[_splice(2, 4, []), forget], options={"allow_fallback": False}
    )
    with pytest.raises(SpliceUnsupportedError):
        run(service.apply(DEFAULT_TENANT, session, body))
    assert handle_of(service, session).view.revision == 1


def test_a_run_that_ends_the_sequence_is_reported_once() -> None:
    """A cut in the middle and tokens appended (an agent's turn): the last request of the
    build is the appended run's own; its rows before the run are loaded, its computed rows
    are the run, and nothing is counted twice."""
    service, _, engine = _stack()
    session = _session(service, TOKENS)
    reply = _apply(service, session, _splice(6, 10, []), _splice(22, 22, [1, 2, 3]))
    new = (*TOKENS[:6], *TOKENS[10:], 1, 2, 3)  # 21 tokens
    old, build = engine.requests[1:]  # the old partial block, then the run's request
    assert old.tokens == padded(TOKENS, BLOCK)
    assert build.tokens == padded(new, BLOCK)
    assert build.kv[6:18] == [f"loaded None {p + 4} -4" for p in range(6, 18)]
    assert build.kv[18:] == ["computed"] * 6  # the run, then filler
    assert reply.fallback_reason is None
    assert (reply.reused_tokens, reply.prefilled_tokens, reply.rotated_tokens) == (18, 3, 12)


def test_a_turn_whose_recipe_block_was_evicted_says_so() -> None:
    """The rows a build left in the last partial block are loaded from its cached copy; if
    vLLM evicted that block before the turn, the turn computes them (in its own context, no
    longer the splice's definition) and reports ``missing_source``."""
    service, backend, engine = _stack()
    session = _session(service, TOKENS)
    _apply(service, session, _splice(2, 3, [1, 2]))  # 23 tokens; rows 20-22 in the recipe
    handle = handle_of(service, session)
    new, salt = handle.view.tokens, handle.private_salt
    evicted = engine.cache.pop((salt, padded(new, BLOCK)))  # the build's last block
    assert evicted[:3] == ["loaded None 19 1", "loaded None 20 1", "computed"]  # 22: the last
    outcome = one_token_turn(backend, handle, new)
    turn = engine.requests[-1]
    assert turn.kv[:20] == ["hit"] * 20 and turn.kv[20:] == ["computed"] * 3
    assert outcome.prefill.fallback_reason == "missing_source"
