"""Where the SGLang backend keeps a session's KV: which ``cache_salt`` namespace of the tree.

Over the scripted scheduler (one token set per namespace): a session with a ``cache_salt``
lives in SGLang's namespace of that salt (shared with every request that carries it); the
first splice that keeps downstream KV, or the first compose, moves the session to a
namespace of its own (that KV is not a prefill of its tokens), where every later write and
generate goes; a forget after that purges both; closing the session purges its own.
SGLang's real tree is in ``tests/sglang``, and the live server's in ``tests/live``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT, SessionStore
from leyline.protocol import Limits, Path
from leyline.protocol.directives import ComposeDirective, ForgetDirective, SpliceDirective
from leyline.protocol.resources import ApplyDirectives, SessionCreate, SkillCreate
from leyline.protocol.spans import TokenSpan
from leyline.sglang.backend import SglangBackend

from .scripted_scheduler import ScriptedScheduler

OLD = tuple(range(100, 160))
SKILL = tuple(range(500, 520))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _service() -> tuple[SessionService[Any], ScriptedScheduler, SglangBackend]:
    scheduler = ScriptedScheduler()
    backend = SglangBackend(scheduler, None, limits=Limits(), vocab_size=1 << 16)
    return SessionService(backend, SessionStore(backend)), scheduler, backend


def _apply(service: SessionService[Any], session: str, revision: int, directive: Any) -> Any:
    body = ApplyDirectives(base_revision=revision, directives=[directive])
    return run(service.apply(DEFAULT_TENANT, session, body))


def _handle(service: SessionService[Any], session: str) -> Any:
    return service.store.get(DEFAULT_TENANT, session).handle


def test_a_cache_salt_is_sglangs_own_and_isolates_the_session() -> None:
    service, scheduler, backend = _service()
    assert backend.capabilities().cache_salt
    body = SessionCreate(session="s", tokens=list(OLD), cache_salt="team-1")
    run(service.create(DEFAULT_TENANT, body))
    assert scheduler.cached_length(OLD, "team-1") == len(OLD)
    assert scheduler.cached_length(OLD) == 0  # the public namespace has none of it
    run(service.create(DEFAULT_TENANT, SessionCreate(session="p", tokens=list(OLD))))
    assert scheduler.cached_length(OLD) == len(OLD)
    # An edit that keeps nothing downstream is exact: it stays in the salt's namespace.
    response = _apply(
        service, "s", 1, SpliceDirective(span=TokenSpan(start=50, end=60), replacement=[1, 2])
    )
    assert response.path is Path.splice
    tail = (*OLD[:50], 1, 2)
    assert scheduler.cached_length(tail, "team-1") == len(tail)
    assert _handle(service, "s").private_salt is None


def test_a_splice_that_keeps_downstream_kv_moves_the_session_to_its_own_namespace() -> None:
    """The kept tokens attended to the cut span: no other request may match them."""
    service, scheduler, _ = _service()
    body = SessionCreate(session="s", tokens=list(OLD), cache_salt="team-1")
    run(service.create(DEFAULT_TENANT, body))
    response = _apply(
        service, "s", 1, SpliceDirective(span=TokenSpan(start=10, end=20), replacement=[7])
    )
    assert response.path is Path.splice
    handle = _handle(service, "s")
    private = handle.private_salt
    assert private is not None and handle.shared_salt == "team-1"
    new = (*OLD[:10], 7, *OLD[20:])
    assert scheduler.cached_length(new, private) == len(new)
    assert scheduler.cached_length(new, "team-1") == 10  # the exact prefix only
    assert scheduler.cached_length(new) == 0
    # A forget of the same span by another session of the salt re-prefills exactly: the
    # shared namespace never held the spliced KV.
    run(
        service.create(
            DEFAULT_TENANT, SessionCreate(session="q", tokens=list(OLD), cache_salt="team-1")
        )
    )
    forget = ForgetDirective(span=TokenSpan(start=10, end=20), replacement=[7])
    assert _apply(service, "q", 1, forget).path is Path.reprefill
    assert _handle(service, "q").private_salt is None


def test_closing_a_private_session_purges_its_namespace() -> None:
    async def scenario() -> tuple[ScriptedScheduler, str]:
        service, scheduler, _ = _service()
        await service.create(DEFAULT_TENANT, SessionCreate(session="s", tokens=list(OLD)))
        body = ApplyDirectives(
            base_revision=1,
            directives=[SpliceDirective(span=TokenSpan(start=10, end=20), replacement=[])],
        )
        await service.apply(DEFAULT_TENANT, "s", body)
        private = _handle(service, "s").private_salt
        assert private is not None
        assert scheduler.cached_length(OLD[:10] + OLD[20:], private) == 50
        await service.delete(DEFAULT_TENANT, "s")
        for _ in range(3):  # the purge runs in the background
            await asyncio.sleep(0)
        return scheduler, private

    scheduler, private = run(scenario())
    assert scheduler.cached_length(OLD[:10] + OLD[20:], private) == 0
    assert scheduler.cached_length(OLD) == len(OLD)  # the exact, shared KV stays


def test_the_first_compose_moves_the_session_to_its_own_namespace_for_good() -> None:
    service, scheduler, _ = _service()
    run(service.create(DEFAULT_TENANT, SessionCreate(session="s", tokens=list(OLD))))
    run(service.create_skill(DEFAULT_TENANT, SkillCreate(skill="k", tokens=list(SKILL))))
    response = _apply(service, "s", 1, ComposeDirective(skill="k", at=30, seam_tokens=2))
    assert response.path is Path.splice
    handle = _handle(service, "s")
    private = handle.private_salt
    assert private is not None and handle.shared_salt is None
    assert set(handle.lineages) == {None, private}  # the shared namespace still caches OLD
    composed = OLD[:30] + SKILL + OLD[30:]
    assert scheduler.cached_length(composed, private) == len(composed)
    assert scheduler.cached_length(composed) == 30  # nobody else reads the composed KV
    _apply(service, "s", 2, SpliceDirective(span=TokenSpan(start=70, end=75), replacement=[]))
    assert handle.private_salt == private  # later writes stay there
    spliced = composed[:70] + composed[75:]
    assert scheduler.cached_length(spliced, private) == len(spliced)


def test_a_forget_after_a_compose_purges_the_shared_namespace_too() -> None:
    """The forgotten tokens also sit in the shared namespace's copy of the session from
    before the compose (at other positions): it is purged from where they sit there."""
    service, scheduler, _ = _service()
    run(service.create(DEFAULT_TENANT, SessionCreate(session="s", tokens=list(OLD))))
    run(service.create_skill(DEFAULT_TENANT, SkillCreate(skill="k", tokens=list(SKILL))))
    _apply(service, "s", 1, ComposeDirective(skill="k", at=30, seam_tokens=2))
    private = _handle(service, "s").private_salt
    forget = ForgetDirective(
        span=TokenSpan(start=60, end=66), replacement=[]
    )  # OLD[40:46], moved by 20
    response = _apply(service, "s", 2, forget)
    assert response.path is Path.reprefill
    assert scheduler.cached_length(OLD) == 40  # purged from where the span sits there
    composed = OLD[:30] + SKILL + OLD[30:]
    assert scheduler.cached_length(composed, private) == 60


def test_a_private_sessions_forget_purges_a_strangers_copy_of_its_tokens() -> None:
    """A plain request may have prefilled the session's (spliced) tokens exactly in the
    shared namespace: that KV holds the forgotten span too, and goes with the forget."""
    service, scheduler, _ = _service()
    run(service.create(DEFAULT_TENANT, SessionCreate(session="s", tokens=list(OLD))))
    _apply(service, "s", 1, SpliceDirective(span=TokenSpan(start=10, end=20), replacement=[]))
    spliced = OLD[:10] + OLD[20:]
    run(scheduler.prefill(spliced))  # a stranger's exact prefill of the same tokens
    forget = ForgetDirective(span=TokenSpan(start=30, end=35), replacement=[])
    assert _apply(service, "s", 2, forget).path is Path.reprefill
    assert scheduler.cached_length(spliced) == 30


def test_a_forget_purges_every_earlier_lineage_from_where_the_span_sits() -> None:
    """The session re-sent its tokens edited before the span (a diverging prompt): the
    tree still caches the first version, the span at another position. A FORGET must purge
    it there too, and keep what comes before the span."""
    service, scheduler, backend = _service()
    run(service.create(DEFAULT_TENANT, SessionCreate(session="s", tokens=list(OLD))))
    handle = _handle(service, "s")
    edited = (7, 8, 9, *OLD)
    run(backend.prefill(handle, edited, ()))
    assert len(handle.lineages[None]) == 2  # OLD, and the edited tokens
    secret = TokenSpan(start=3 + 40, end=3 + 46)  # OLD[40:46] in the edited tokens
    _apply(service, "s", handle.view.revision, ForgetDirective(span=secret, replacement=[]))
    assert scheduler.cached_length(OLD) == 40  # the first version, purged at the span
    assert scheduler.cached_length(edited) == 43
