"""Sans-IO flows: logic written once, run by a sync shell and an async shell.

A flow is a generator that yields the requests it needs and is sent each one's answer (or
thrown its error); its return value is its result. It never touches a client, so the sync
classes (``LeylineOpenAI``, ``SkillLibrary``) and their async twins share every decision
and differ only in how a request is made: :func:`run` calls, :func:`arun` awaits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

Flow = Generator[Any, Any, T]
"""Yields requests, is sent their answers, returns a ``T``."""


class _Step:
    """Where a flow stands: the request it waits on (``request`` while ``pending``), or
    its ``result``."""

    def __init__(self, flow: Flow[Any]) -> None:
        self._flow = flow
        self.pending = True
        self.result: Any = None
        self.request: Any = self._resume(flow.send, None)

    @contextmanager
    def answering(self) -> Iterator[Callable[[object], None]]:
        """Answer the pending request inside this block: the value given to the callable
        yielded goes into the flow, or the error the block raises is thrown into it."""
        answers: list[object] = []
        try:
            yield answers.append
        except Exception as error:
            self.request = self._resume(self._flow.throw, error)
        else:
            self.request = self._resume(self._flow.send, answers[0])

    def _resume(self, step: Callable[[Any], Any], value: Any) -> Any:
        try:
            return step(value)
        except StopIteration as stop:
            self.pending, self.result = False, stop.value
            return None


def run(flow: Flow[T], perform: Callable[[Any], object]) -> T:
    """Run ``flow`` to its result, making each request with ``perform``."""
    step = _Step(flow)
    while step.pending:
        with step.answering() as answer:
            answer(perform(step.request))
    return step.result  # type: ignore[no-any-return]


async def arun(flow: Flow[T], perform: Callable[[Any], Awaitable[object]]) -> T:
    """:func:`run` for a ``perform`` whose answers are awaited."""
    step = _Step(flow)
    while step.pending:
        with step.answering() as answer:
            answer(await perform(step.request))
    return step.result  # type: ignore[no-any-return]
