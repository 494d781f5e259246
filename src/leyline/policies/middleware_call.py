"""One ``create`` of a wrapper as it goes (:class:`OpenCall`): where it was routed and
what its call record will say; and the small pieces of a call that address its session."""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import quote

from openai.types.chat import ChatCompletion

from leyline.protocol.resources import Routes

from .messages import Message
from .middleware_core import Episode, PreparedCall
from .middleware_wire import ServerSupport, pinned_error
from .retention_marks import Dropped


@dataclass(eq=False)
class OpenCall:
    """One ``create`` as it goes: where it was routed, and what its record will say."""

    episode: Episode
    agent: list[Message]
    support: ServerSupport
    tools: object
    new: bool
    """It opened a new conversation."""
    prepared: PreparedCall | None = None
    t0: float = 0.0
    resync: str | None = None
    lost_session: str | None = None
    """The session this call found lost (it went on in a new one)."""
    reregistered: tuple[str, ...] = ()
    """Skills registered again on the session's worker (routed mode, ``unknown_skill``)."""
    dropped: tuple[Dropped, ...] = ()

    def commit(self, completion: ChatCompletion, *, streamed: bool = False) -> None:
        assert self.prepared is not None
        latency = time.perf_counter() - self.t0
        self.episode.commit(
            self.prepared,
            completion,
            self.support,
            latency,
            self.resync,
            streamed=streamed,
            new_conversation=self.new,
            dropped=self.dropped,
            lost_session=self.lost_session,
            reregistered=self.reregistered,
        )


def session_path(episode: Episode) -> str:
    return Routes.session.format(session=quote(episode.session, safe=""))


def raise_pinned(exc: BaseException, episode: Episode) -> None:
    """A ``pinned_span`` refusal is the caller's to resolve: raise it typed, change nothing."""
    error = pinned_error(exc, episode.session)
    if error is not None:
        raise error from exc
