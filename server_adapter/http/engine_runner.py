"""The reference engine's turn: edit, prefill and generate in one job on the model worker."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ..core.backend import Rendered
from ..core.batch import common_prefix
from ..engine_backend import EngineBackend
from ..session import SessionCache
from .openai_types import ChatMessage, ToolSpec
from .turns import Cancelled, Outcome, Turn


class EngineRunner:
    """``Runner[SessionCache]``: one worker job per turn, so no other request interleaves
    between the edit and the generation, and a job whose client left never starts."""

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
        def work() -> Outcome:
            if turn.cancelled():
                raise Cancelled  # the client left while this waited in the queue
            return _turn(self.backend, turn)

        return await self.backend.run(work)


def _turn(backend: EngineBackend, turn: Turn[SessionCache]) -> Outcome:
    session = turn.handle
    edit = None
    if turn.plan is not None:  # through the backend: a compose needs its skills
        edit = backend.execute_now(session, turn.plan, turn.allow_fallback)
    edited = session.tokens
    if turn.spans is not None:
        spans = turn.spans
    else:  # token ids: the messages the prompt still holds keep their spans
        kept = common_prefix(edited, turn.prompt)
        spans = tuple(span for span in session.spans if span.end <= kept)
    prefill = session.prefill(turn.prompt, spans=spans)
    generation = session.generate(turn.params, on_token=turn.on_token)
    return Outcome(edit, prefill, edited, spans, generation)
