"""The reference engine's turn: edit and prefill as one model job, then the generation in the
scheduler's batched decode steps (``scheduler``)."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from leyline.core.backend import Rendered
from leyline.core.batch import EditPlan, common_prefix
from leyline.core.openai_types import ChatMessage, ToolSpec
from leyline.engine.backend import EngineBackend
from leyline.engine.reports import GenerationResult, OpReport
from leyline.engine.session import PendingGeneration, SessionCache
from leyline.engine.work_estimates import turn_cost
from leyline.protocol.spans import MessageSpan
from leyline.serve.turns import Cancelled, Outcome, Turn, TurnTiming


class ServedBackend(EngineBackend):
    """The engine backend of ``leyline serve``: a plan whose client has left by the time its
    model work would start runs none of it (``EditPlan.cancelled``), so a directive batch
    queued behind other work changes nothing once its client hung up."""

    def execute_now(
        self,
        handle: SessionCache,
        plan: EditPlan,
        allow_fallback: bool,
        final_tokens: Sequence[int] | None = None,
    ) -> OpReport:
        if plan.cancelled is not None and plan.cancelled():
            raise Cancelled
        return super().execute_now(handle, plan, allow_fallback, final_tokens)


class EngineRunner:
    """``Runner[SessionCache]``: one model job per turn up to its first token (the session
    is leased, so no other request of it interleaves), then its decode steps; a job whose
    client left never starts."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend
        self.engine = backend.engine

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    @property
    def stop_token_ids(self) -> Collection[int]:
        return self.engine.loaded.eos_token_ids

    def decode(self, tokens: Sequence[int]) -> str:
        return self.engine.decode(tokens)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None) -> Rendered:
        out = self.backend.require_renderer().render(messages, tools, add_generation_prompt=True)
        return Rendered(out.tokens, out.spans)

    async def run(self, turn: Turn[SessionCache]) -> Outcome:
        inline = self.backend.inline_decode

        def work() -> tuple[_Begun, GenerationResult | None]:
            if turn.cancelled():
                raise Cancelled  # the client left while this waited in the queue
            begun = _begin(self.backend, turn)
            if not inline:
                return begun, None
            # The baseline: the whole generation inside the job, nothing else meanwhile.
            pending = begun.pending
            session = pending.session
            return begun, session.generate_pending(pending)

        purges = turn.plan is not None and turn.plan.forget_from is not None
        (begun, generation), timing = await self.backend.run_timed(
            work, exclusive=purges, cost=_cost(turn)
        )
        queued = timing.queued if timing else 0.0
        service = timing.service if timing else 0.0
        if generation is None:
            t0 = time.perf_counter()
            # The scheduler's decode steps run this generation batched with the others.
            generation = await self.backend.generate(begun.pending)
            decode = time.perf_counter() - t0
        else:
            decode = generation.seconds
            service = max(0.0, service - decode)
        spent = TurnTiming(queued, service, decode)
        return Outcome(begun.edit, begun.prefill, begun.edited, begun.spans, generation, spent)


@dataclass(frozen=True, slots=True)
class _Begun:
    edit: OpReport | None
    prefill: OpReport
    edited: tuple[int, ...]
    spans: tuple[MessageSpan, ...]
    pending: PendingGeneration


def _cost(turn: Turn[SessionCache]) -> int:
    """Tokens the turn's job runs through the model (the scheduler's size estimate)."""
    plan = turn.plan
    if plan is None:
        return turn_cost(turn.handle.tokens, (), (), turn.prompt)
    return turn_cost(plan.tokens, plan.edits, plan.composes, turn.prompt)


def _begin(backend: EngineBackend, turn: Turn[SessionCache]) -> _Begun:
    """The turn up to its first token: the plan executed, the prompt prefilled, the
    generation begun (its decode steps are the scheduler's)."""
    session = turn.handle
    edit = None
    if turn.plan is not None:  # through the backend: a compose needs its skills
        edit = backend.execute_now(session, turn.plan, turn.allow_fallback, turn.prompt)
    edited = session.tokens
    if turn.spans is not None:
        spans = turn.spans
    else:  # token ids: the messages the prompt still holds keep their spans
        kept = common_prefix(edited, turn.prompt)
        spans = tuple(span for span in session.spans if span.end <= kept)
    # Room for the reply in the new KV's buffers: the decoder writes there, no second copy.
    prefill = session.prefill(turn.prompt, spans=spans, reserve=turn.params.max_new_tokens)
    pending = session.begin_generation(turn.params, on_token=turn.on_token)
    return _Begun(edit, prefill, edited, spans, pending)
