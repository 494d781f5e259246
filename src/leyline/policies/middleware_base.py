"""What :class:`~.middleware.LeylineOpenAI` and :class:`~.middleware_async.AsyncLeylineOpenAI`
share: their state, and what makes them drop-ins for the client they wrap.

* the client's attributes (``base_url``, ``api_key``, ``organization``, ``project``,
  ``timeout``, ``max_retries``) and every other resource (``models``, ``embeddings``,
  ``responses``, ...) are the wrapped client's; only ``chat.completions.create`` is Leyline's;
* ``with_options(...)`` / ``copy(...)`` wrap the client's copy and keep the conversations
  (same policy, same sessions, same records): a framework's retry with other options goes
  on with the episode instead of bypassing it. A copy for another ``base_url`` is another
  server: it starts its own conversations, with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

import openai

from .counting import TokenCounter
from .middleware_core import CallRecord, Conversations, Episode
from .middleware_wire import ServerSupport
from .planner import Pinned, TurnPlanner
from .registry import PolicyConfig, parse_policy
from .skills import SkillSet
from .translate import Addressing

C = TypeVar("C", openai.OpenAI, openai.AsyncOpenAI)


@dataclass
class WrapperState:
    """One wrapper's state, shared with its ``with_options`` copies."""

    conversations: Conversations
    skills: SkillSet | None
    lock: Any
    """``threading.Lock`` or ``asyncio.Lock``: one call at a time plans and commits."""
    support: ServerSupport | None = None
    warned: bool = False

    def fresh(self, lock: Any) -> WrapperState:
        """The same settings, nothing of the conversations (for another server)."""
        old = self.conversations
        conversations = Conversations(
            old.make_planner, None, directives=old.directives, detect=old.detect, limit=old.limit
        )
        return WrapperState(conversations, self.skills, lock)


class WrapperBase(Generic[C]):
    """The attributes and the state of a wrapper around an OpenAI client ``C``."""

    client: C
    _state: WrapperState

    def __init__(
        self,
        client: C,
        policy: PolicyConfig | None = None,
        *,
        session: str | None = None,
        directives: bool = True,
        counter: TokenCounter | None = None,
        addressing: Addressing = "auto",
        pinned: Pinned | None = None,
        skills: SkillSet | None = None,
        detect_conversations: bool = True,
        max_conversations: int = 8,
    ) -> None:
        parsed = parse_policy(policy) if policy is not None else None  # errors now, not later

        def make_planner() -> TurnPlanner:
            return TurnPlanner(parsed, counter=counter, addressing=addressing, pinned=pinned)

        conversations = Conversations(
            make_planner,
            session,
            directives=directives,
            detect=detect_conversations,
            limit=max_conversations,
        )
        self._bind(client, WrapperState(conversations, skills, self._new_lock()))

    def _bind(self, client: C, state: WrapperState) -> None:
        self.client = client
        self._state = state
        self.chat = self._make_chat()

    @staticmethod
    def _new_lock() -> Any:
        raise NotImplementedError

    def _make_chat(self) -> Any:
        raise NotImplementedError

    # -- the episode ------------------------------------------------------------------

    @property
    def conversations(self) -> Conversations:
        return self._state.conversations

    @property
    def episode(self) -> Episode:
        """The episode of the current (last used) conversation."""
        return self._state.conversations.current

    @property
    def session(self) -> str:
        """The Leyline session of the current conversation."""
        return self.episode.session

    @property
    def planner(self) -> TurnPlanner:
        return self.episode.planner

    @property
    def records(self) -> list[CallRecord]:
        """One record per completed call, in order (every conversation's)."""
        return self._state.conversations.records

    @property
    def skills(self) -> SkillSet | None:
        return self._state.skills

    # -- a drop-in for the wrapped client ---------------------------------------------

    @property
    def base_url(self) -> Any:
        return self.client.base_url

    @property
    def api_key(self) -> str:
        return self.client.api_key

    @property
    def organization(self) -> str | None:
        return self.client.organization

    @property
    def project(self) -> str | None:
        return self.client.project

    @property
    def timeout(self) -> Any:
        return self.client.timeout

    @property
    def max_retries(self) -> int:
        return self.client.max_retries

    def copy(self, **options: Any) -> Self:
        """A wrapper of ``client.copy(**options)`` that keeps this one's conversations
        (unless ``base_url`` changes: another server, new conversations)."""
        client = self.client.copy(**options)
        state = self._state
        if str(client.base_url) != str(self.client.base_url):
            state = state.fresh(self._new_lock())
        twin = object.__new__(type(self))
        twin._bind(client, state)
        return twin

    with_options = copy

    def __getattr__(self, name: str) -> Any:
        """Everything else is the wrapped client's (``models``, ``embeddings``, ...)."""
        if name.startswith("__") or "client" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["client"], name)
