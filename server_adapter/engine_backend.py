"""The reference engine as a session-core backend: a ``SessionCache`` per session.

All model work runs on one worker thread (this CPU runs one forward at a time well; more
would only thrash): ``run`` queues a closure there and awaits it, so requests queue fairly.
Rendering and tokenizing need no model and run on their own threads, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from leyline.protocol import PROTOCOL_VERSION, Capabilities, ErrorCode, LeylineError, Limits
from leyline.protocol.resources import Message
from leyline.protocol.spans import MessageSpan

from .chat.render import ChatRenderer
from .core.backend import Rendered
from .core.batch import EditPlan, SessionView
from .core.report import OpReport
from .engine import Engine
from .http.openai_types import parse_chat
from .session import EXECUTED_VERBS, SessionCache

T = TypeVar("T")


class EngineBackend:
    """``Backend[SessionCache]`` over one reference :class:`Engine`."""

    def __init__(self, engine: Engine, *, limits: Limits, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._limits = limits
        self.renderer = ChatRenderer(engine.tokenizer) if engine.tokenizer is not None else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leyline-model")

    # -- the worker -------------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model worker and await it."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # -- what the server speaks ---------------------------------------------------------

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def capabilities(self) -> Capabilities:
        layouts = [] if self.engine.layout is None else [self.engine.layout.kind]
        return Capabilities(
            protocol_version=PROTOCOL_VERSION,
            verbs=list(EXECUTED_VERBS),
            architectures=layouts,
            models=[self.model_name],
            limits=self._limits,
        )

    def encode(self, text: str) -> tuple[int, ...]:
        return self.engine.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.engine.decode(tokens)

    def require_renderer(self) -> ChatRenderer:
        if self.renderer is None:
            raise LeylineError(
                ErrorCode.invalid_directive,
                f"{self.engine.loaded.label} has no tokenizer or chat template; send token ids "
                "to /v1/completions",
                "messages",
            )
        return self.renderer

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Message] | None,
        *,
        add_generation_prompt: bool,
    ) -> Rendered:
        chat, specs = parse_chat(messages, tools)
        out = self.require_renderer().render(
            chat, specs, add_generation_prompt=add_generation_prompt
        )
        return Rendered(out.tokens, out.spans)

    # -- handles ------------------------------------------------------------------------

    def open(self, salt: str) -> SessionCache:
        return SessionCache(self.engine, salt=salt)

    def view(self, handle: SessionCache) -> SessionView:
        return handle.view

    def nbytes(self, handle: SessionCache) -> int:
        return sum(t.numel() * t.element_size() for layer in handle.kv for t in layer)

    def close(self, handle: SessionCache) -> None:
        handle.release()

    async def prefill(
        self, handle: SessionCache, tokens: Sequence[int], spans: Sequence[MessageSpan]
    ) -> OpReport:
        return await self.run(lambda: handle.prefill(tokens, spans=spans))

    async def execute(
        self, handle: SessionCache, plan: EditPlan, *, allow_fallback: bool
    ) -> OpReport:
        return await self.run(lambda: handle.execute(plan, allow_fallback=allow_fallback))
