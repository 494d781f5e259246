"""Leyline sessions and directives in front of SGLang: the same protocol as ``leyline serve``.

A session is a token sequence and a revision, kept in the server process. A directive batch
is resolved and checked with the protocol's own code (``resolve_batch``, ``apply_edits``),
then executed in the scheduler over a :class:`SchedulerLink`. After it, an ordinary SGLang
``/generate`` with the session's tokens (``GET /leyline/v1/sessions/{id}?tokens=true``) hits
the cache for all but the last token.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from leyline.protocol import (
    Directive,
    ErrorCode,
    FallbackReason,
    LeylineError,
    LeylineResponse,
    Limits,
    Mode,
    Path,
    Verb,
    apply_edits,
    resolve_batch,
)
from leyline.protocol.algebra import Edit
from leyline.server_adapter.errors import SpliceUnsupportedError

from .wire import LeylineSpliceReqInput, LeylineSpliceReqOutput

EXECUTED_VERBS = (Verb.splice, Verb.forget, Verb.erratum)


class SchedulerLink(Protocol):
    async def send(self, req: LeylineSpliceReqInput) -> LeylineSpliceReqOutput: ...

    async def prefill(self, tokens: Sequence[int]) -> None:
        """Run an ordinary generate over ``tokens`` so the tree caches them."""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    tokens: tuple[int, ...]
    revision: int


class DirectiveService:
    def __init__(
        self, link: SchedulerLink, tokenize: Callable[[str], Sequence[int]], limits: Limits
    ) -> None:
        self.link, self.tokenize, self.limits = link, tokenize, limits
        self._sessions: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()

    def get(self, session: str) -> SessionRecord:
        record = self._sessions.get(session)
        if record is None:
            raise LeylineError(ErrorCode.unknown_session, f"no session {session!r}", "session")
        return record

    async def create(self, session: str | None, tokens: Sequence[int]) -> tuple[str, SessionRecord]:
        session = session or uuid.uuid4().hex
        if tokens:
            await self.link.prefill(tokens)
        record = SessionRecord(tuple(tokens), 0)
        with self._lock:
            self._sessions[session] = record
        return session, record

    def delete(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    async def apply(
        self,
        session: str,
        directives: Sequence[Directive],
        base_revision: int,
        allow_fallback: bool,
    ) -> LeylineResponse:
        """Resolve, execute in the scheduler, commit; all-or-nothing per the protocol."""
        record = self.get(session)
        if base_revision != record.revision:
            raise LeylineError(
                ErrorCode.revision_conflict,
                f"session {session} is at revision {record.revision}, not {base_revision}",
                "base_revision",
            )
        batch = resolve_batch(
            directives,
            length=len(record.tokens),
            tokenize=self.tokenize,
            limits=self.limits,
            supported=EXECUTED_VERBS,
        )
        result = apply_edits(record.tokens, batch.edits)
        new = result.tokens
        if result.is_identity:
            return self._answer(session, record, Path.splice, len(new), 0)
        forgets = [e.start for e in batch.edits if Mode(e.mode) is Mode.forget]
        if forgets:
            req = self._request("forget", record.tokens, batch.edits)
            out = self._checked(await self.link.send(req))
            kept = min(out.cached_tokens, min(forgets))
            return self._commit(session, record, new, Path.reprefill, kept, 0)
        if result.first_change == len(record.tokens):  # errata only: the generate appends
            return self._commit(session, record, new, Path.prefix_hit, len(record.tokens), 0)
        return await self._splice(
            session, record, new, batch.edits, allow_fallback, result.first_change
        )

    async def _splice(
        self,
        session: str,
        record: SessionRecord,
        new: tuple[int, ...],
        edits: Sequence[Edit],
        allow_fallback: bool,
        first_change: int,
    ) -> LeylineResponse:
        req = self._request("splice", record.tokens, edits)
        # Each inserted run may need one generate; a repeat of the same request means the
        # prefill did not land in the tree, and the splice gives up rather than loop.
        asked: set[int] = set()
        while True:
            out = self._checked(await self.link.send(req))
            if out.ok and out.pending_prefill is None:
                reason = FallbackReason(out.fallback_reason) if out.fallback_reason else None
                return self._commit(
                    session, record, new, Path.splice, out.reused_tokens, out.rotated_tokens, reason
                )
            if not out.ok or out.pending_prefill in asked:
                reason = FallbackReason(out.fallback_reason or FallbackReason.unsupported_runtime)
                if not allow_fallback:
                    raise SpliceUnsupportedError(reason, out.message or "prefill did not cache")
                # The next generate re-prefills from the first change (SGLang's prefix match).
                return self._commit(session, record, new, Path.reprefill, first_change, 0, reason)
            assert out.pending_prefill is not None
            asked.add(out.pending_prefill)
            await self.link.prefill(new[: out.pending_prefill])

    @staticmethod
    def _request(verb: str, tokens: Sequence[int], edits: Sequence[Edit]) -> LeylineSpliceReqInput:
        wire = [(e.start, e.end, list(e.replacement)) for e in edits]
        return LeylineSpliceReqInput(verb=verb, old_tokens=list(tokens), edits=wire)

    @staticmethod
    def _checked(out: LeylineSpliceReqOutput) -> LeylineSpliceReqOutput:
        if out.error_code is not None:
            raise LeylineError(ErrorCode(out.error_code), out.message, out.error_field)
        return out

    def _commit(
        self,
        session: str,
        record: SessionRecord,
        new: tuple[int, ...],
        path: Path,
        reused: int,
        rotated: int,
        reason: FallbackReason | None = None,
    ) -> LeylineResponse:
        committed = SessionRecord(new, record.revision + 1)
        with self._lock:
            if self._sessions.get(session) is not record:
                raise LeylineError(
                    ErrorCode.revision_conflict, "the session changed meanwhile", "base_revision"
                )
            self._sessions[session] = committed
        return self._answer(session, committed, path, reused, rotated, reason)

    @staticmethod
    def _answer(
        session: str,
        record: SessionRecord,
        path: Path,
        reused: int,
        rotated: int,
        reason: FallbackReason | None = None,
    ) -> LeylineResponse:
        n = len(record.tokens)
        return LeylineResponse(
            session=session,
            revision=record.revision,
            path=path,
            reused_tokens=min(reused, n),
            prefilled_tokens=n - min(reused, n),
            rotated_tokens=rotated,
            fallback_reason=reason,
        )
