"""One ``LeylineService`` on either backend, for the core's chat-turn tests: the reference
engine (``EngineBackend``, real SmolLM2) or SGLang's (``SglangBackend``) over a scripted
scheduler and a scripted generator that answers the same ids every turn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from leyline.core.openai_types import ChatCompletionRequest
from leyline.engine.backend import EngineBackend
from leyline.engine.engine import Engine
from leyline.protocol import Limits
from leyline.serve.service import LeylineService
from leyline.serve.settings import ServerSettings
from leyline.sglang.backend import SglangBackend

from .scripted_scheduler import ScriptedGenerator, ScriptedScheduler

LIMITS = Limits(max_session_tokens=1024)
BACKENDS = ["engine", "sglang"]


def make_service(
    kind: str,
    engine: Engine,
    reply: str,
    model_name: str,
    sglang: type[SglangBackend] = SglangBackend,
    **settings: Any,
) -> tuple[LeylineService[Any], Any]:
    """The service and its backend; on ``sglang`` every generation is ``reply``'s ids."""
    config = ServerSettings(**settings)
    if kind == "engine":
        backend: Any = EngineBackend(engine, limits=LIMITS, model_name="smollm2")
        return LeylineService(backend, config, model_name=model_name), backend
    scheduler = ScriptedScheduler()
    stop = engine.loaded.eos_token_ids[0]
    backend = sglang(
        scheduler,
        engine.tokenizer,
        limits=LIMITS,
        vocab_size=engine.vocab_size,
        stop_token_ids=[stop],
    )
    backend.generator = ScriptedGenerator(scheduler, engine.encode(reply), stop, backend.decode)
    return LeylineService(backend, config, model_name=model_name), backend


def serving(
    kind: str, engine: Engine, reply: str, model_name: str, **settings: Any
) -> Iterator[LeylineService[Any]]:
    """``make_service`` for a fixture: the engine backend's scheduler is shut down after."""
    service, backend = make_service(kind, engine, reply, model_name, **settings)
    yield service
    if kind == "engine":
        backend.shutdown()


def conversation(tool: str, ask: str, answer: str, *more: dict[str, Any]) -> list[dict[str, Any]]:
    """A terse system prompt, the user's ``ask``, the assistant's ``answer``, ``tool`` pasted
    by the user, then ``more``."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": tool},
        *more,
    ]


def chat(service: LeylineService[Any], messages: list[dict[str, Any]], **leyline: Any) -> Any:
    body = {"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0}
    request = ChatCompletionRequest.model_validate(body | {"leyline": leyline})
    return asyncio.run(service.chat(request))
