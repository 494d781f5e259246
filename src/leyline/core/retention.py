"""Retention on the session core: pins, decay and scratch marks kept per session.

The rules are the protocol's (``leyline.protocol.retention.Marks``); this keeps each
session's marks in step with what its backend executes, and executes drops as ordinary
edit plans, so both backends drop spans the same way: a scratch at the end of the turn that
follows it, a decay when the store is over a byte budget (``SessionStore.relieve``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Generic

from leyline.core.backend import Backend, H
from leyline.core.batch import EditPlan, common_prefix, plan_edits
from leyline.core.sessions import Session, SessionStore
from leyline.protocol import LeylineResponse
from leyline.protocol.algebra import Edit
from leyline.protocol.envelope import DroppedSpan
from leyline.protocol.retention import Mark

log = logging.getLogger(__name__)


class Retention(Generic[H]):
    def __init__(
        self,
        backend: Backend[H],
        store: SessionStore[H],
        *,
        on_op: Callable[[LeylineResponse], None] = lambda r: None,
    ) -> None:
        self.backend = backend
        self.store = store
        self._on_op = on_op
        store.drop = self.drop

    def now(self) -> float:
        return self.store.clock()

    # -- keeping marks in step -------------------------------------------------------------

    def executed(self, session: Session[H], plan: EditPlan) -> None:
        """``plan`` ran on the session: its marks move, and the batch's own are added."""
        session.marks = session.marks.after(plan.edits, plan.marks, self.now())

    def check_prompt(
        self, session: Session[H], held: Sequence[int], tokens: Sequence[int], where: str
    ) -> None:
        """A prompt that diverges from what the session holds (``held``, once its batch
        ran) re-prefills over what follows the divergence: refused (``pinned_span``) if a
        live pin lies there."""
        kept = common_prefix(held, tokens)
        session.marks.check_divergence(kept, len(held), self.now(), where)

    def prompted(self, session: Session[H], held: Sequence[int], tokens: Sequence[int]) -> None:
        """The session went from ``held`` to ``tokens`` (a prompt brought in): marks past
        where they diverge are gone (decay and scratch; pins were checked)."""
        kept = common_prefix(held, tokens)
        if kept < len(held):
            edit = Edit(kept, len(held), tuple(tokens[kept:]))
            session.marks = session.marks.after([edit], now=self.now())

    # -- drops -----------------------------------------------------------------------------

    async def end_turn(self, session: Session[H]) -> None:
        """A generation on the (held) session completed: drop its scratch spans."""
        scratches = session.marks.scratches()
        if scratches:
            await self.drop(session, scratches)

    async def drop(self, session: Session[H], marks: list[Mark]) -> None:
        """Execute the drop of ``marks`` (decay or scratch marks of the held session) as one
        batch; the session's next response reports them (``Session.dropped``)."""
        view = self.backend.view(session.handle)
        ordered = sorted(marks, key=lambda m: m.start)
        edits = [m.as_edit(i) for i, m in enumerate(ordered)]
        limits = self.backend.limits.model_copy(
            update={"max_directives": None, "max_replacement_tokens": None}
        )
        plan = plan_edits(view, edits, limits=limits, vocab_size=self.backend.vocab_size)
        report = await self.backend.execute(session.handle, plan, allow_fallback=True)
        session.marks = session.marks.without(ordered)
        session.dropped.extend(
            DroppedSpan(
                verb=m.verb.value,
                start=m.start,
                end=m.end,
                revision=report.revision,
                replacement_tokens=len(m.replacement),
            )
            for m in ordered
        )
        self._on_op(report.to_response(session.id, plan.spans))
        log.info(
            "session %s: dropped %s at revision %d",
            session.id,
            ", ".join(f"{m.verb}[{m.start},{m.end})" for m in ordered),
            report.revision,
        )
