"""The session core over ``VllmBackend`` on the fake engine: what the backend's unit tests
drive (``test_backend``, ``test_compose``)."""

from __future__ import annotations

import asyncio
from typing import Any

from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT, SessionStore
from leyline.core.turns import SamplingParams, Turn
from leyline.protocol import Limits
from leyline.vllm.backend import VllmBackend, VllmSession

from ._fake_engine import FakeEngine

Stack = tuple[SessionService[VllmSession], VllmBackend, FakeEngine]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def stack(engine: FakeEngine, tokenizer: Any = None, **backend: Any) -> Stack:
    """The service, its backend on ``engine`` (vocabulary 1000) and the engine."""
    built = VllmBackend(
        engine,
        tokenizer,
        limits=Limits(),
        vocab_size=1000,
        block_size=engine.block_size,
        **backend,
    )
    return SessionService(built, SessionStore(built)), built, engine


def handle_of(service: SessionService[VllmSession], session: str) -> VllmSession:
    return service.store.get(DEFAULT_TENANT, session).handle


def one_token_turn(backend: VllmBackend, session: VllmSession, prompt: tuple[int, ...]) -> Any:
    """A turn of ``prompt`` in ``session`` that samples one token."""
    turn: Turn[VllmSession] = Turn(
        session, None, prompt, None, SamplingParams(max_new_tokens=1), lambda t: True, lambda: False
    )
    return run(backend.run_turn(turn))
