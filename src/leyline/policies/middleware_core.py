"""What the OpenAI-client wrappers share: the episode state and the per-call records.

No I/O here: :mod:`.middleware` (``openai.OpenAI``) and :mod:`.middleware_async`
(``openai.AsyncOpenAI``) send the requests, with the helpers of :mod:`.middleware_wire`;
:class:`Episode` decides what goes in them and records what came back, on top of
:class:`~.planner.TurnPlanner`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from pydantic import BaseModel, ValidationError

from leyline.protocol import LeylineRequest, LeylineResponse, SpliceDirective, TokenSpan
from leyline.protocol.resources import SessionInfo

from .align import align_messages
from .messages import Message, canonical_json, content_text, message_key
from .middleware_wire import LEYLINE_KEY, ServerSupport
from .planner import TurnPlan, TurnPlanner
from .retention_marks import Dropped


@dataclass(frozen=True, slots=True)
class CallRecord:
    """What one chat call sent and what the server did with it."""

    call: int
    """0-based index of the call in the episode."""
    session: str | None
    leyline: bool
    """The server speaks Leyline. False: edits went as plain messages (re-prefilled)."""
    path: str | None
    """``splice``, ``reprefill`` or ``prefix_hit`` as the server reported (None: no report)."""
    reused_tokens: int | None
    prefilled_tokens: int | None
    rotated_tokens: int | None
    fallback_reason: str | None
    """Why the server ran another path than asked (its ``fallback_reason``)."""
    latency_s: float
    """Wall time of the chat request(s) of this call, generation included."""
    messages: int
    edits: int
    """Edits the policy proposed this call."""
    directives: int
    """Directives sent (0 on a plain server or in messages-only mode)."""
    plan_fallback: str | None = None
    """Why the edits could not be expressed as directives (they went as messages)."""
    resync: str | None = None
    """Why the request failed and was re-sent as plain messages: the Leyline error code
    (``revision_conflict``, ...), ``HTTP 503``, ..., or ``session_lost`` (the server no
    longer had the session: see ``lost_session``)."""
    revision: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    composed: tuple[str, ...] = ()
    """Skills the server composed this call (their ids, in batch order)."""
    skill_notes: tuple[str, ...] = ()
    """Why new skill messages went as text (prefilled) rather than as composes."""
    verbs: tuple[str, ...] = ()
    """The verb of each directive sent, in batch order (``splice``, ``forget``, ``compose``,
    ...); the wrapper's deletion of an unsent reply is a ``splice`` too."""
    cleared_tokens: int = 0
    """Tokens the policy's edits of this call took out of the context (net of any summary
    put in), counted with the planner's counter."""
    cleared_tool_uses: tuple[str, ...] = ()
    """Tool calls (ids) whose outputs or arguments this call's edits cleared or removed."""
    streamed: bool = False
    """The call was streamed (``stream=True``); the record is made when the stream ends."""
    new_conversation: bool = False
    """The messages did not continue the previous conversation: this call opened a new
    session (see ``LeylineOpenAI(detect_conversations=...)``)."""
    dropped: tuple[Dropped, ...] = ()
    """Spans the server dropped and the wrapper mirrored this call: ``decay`` spans dropped
    under memory pressure (learnt from a ``revision_conflict`` before the call was re-sent)
    and ``scratch`` spans dropped at the end of this call's turn."""
    lost_session: str | None = None
    """The session the server no longer had (``resync == "session_lost"``): the call went
    on in a new session, ``session``, prefilled from its messages."""
    reregistered: tuple[str, ...] = ()
    """Routed mode: skills (their ids) the session's worker did not have
    (``resync == "unknown_skill"``) and that were registered again with the session's
    routing key: their messages went as text this call, and compose from the next."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """One request as planned: the plan and the ``leyline`` object to send (None: none)."""

    plan: TurnPlan
    leyline: dict[str, object] | None


@dataclass(frozen=True, slots=True)
class _Reply:
    """The reply generated last call: it sits in the cache after the sent messages."""

    message: Message
    start: int
    """End of the last sent message's tokens (the generation prompt starts here)."""
    end: int
    """End of the cached sequence: prompt plus generated tokens."""


class Episode:
    """One agent episode on one session: the planner, and what the last reply left cached.

    ``directives=False`` sends the edited messages in the session without directives: the
    server reuses the longest unchanged prefix and re-prefills the rest (a baseline arm).
    """

    def __init__(
        self,
        planner: TurnPlanner,
        session: str,
        *,
        directives: bool = True,
        records: list[CallRecord] | None = None,
    ) -> None:
        self.planner, self.session, self.directives = planner, session, directives
        self.records: list[CallRecord] = records if records is not None else []
        """The records of every call (shared by all the episodes of one wrapper)."""
        self.last_plan: TurnPlan | None = None
        """The plan of the last completed call (its ``edits``, ``directives``, ``messages``)."""
        self.pending: object | None = None
        """A stream sent on this episode and not yet read to its end."""
        self.answered = False
        """The server answered a call in ``session``: it exists there, and later calls say
        it must (``options.require_session``, where the server offers it)."""
        self.losses = 0
        """Sessions of this episode the server lost (each went on in a new one)."""
        self._origin = session
        self._reply: _Reply | None = None

    def prepare(self, messages: Sequence[Message], support: ServerSupport) -> PreparedCall:
        """Plan the call (runs the policy, and the planner's ``render`` when it needs it).

        Raises:
            TranscriptError, PolicyEditError: from the planner; nothing changed.
        """
        reply = self._reply
        tail = TokenSpan(start=reply.start, end=reply.end) if reply is not None else None
        # An unsent reply is replaced by the first appended message, when the batch edits
        # anyway: the server keeps what the two share (the generation prompt at least).
        unsent = reply is not None and self.directives and not self._reply_sent(messages)
        plan = self.planner.plan(messages, tail=tail, replace_tail=unsent)
        if not support.leyline:
            return PreparedCall(plan, None)
        required = self.answered and support.require_session
        if not self.directives:
            request = _required(LeylineRequest(session=self.session), required)
            return PreparedCall(plan, request.model_dump(mode="json"))
        if (
            plan.directives
            and reply is not None
            and not plan.tail_replaced  # a message or compose after the sent ones replaced it
            and not self._reply_sent(plan.messages)
        ):
            plan = replace(plan, directives=(*plan.directives, self._drop_reply(reply)))
        request = _required(plan.leyline(self.session), required)
        return PreparedCall(plan, request.model_dump(mode="json", exclude_none=True))

    def commit(
        self,
        prepared: PreparedCall,
        completion: BaseModel,
        support: ServerSupport,
        latency_s: float,
        resync: str | None = None,
        *,
        streamed: bool = False,
        new_conversation: bool = False,
        dropped: tuple[Dropped, ...] = (),
        lost_session: str | None = None,
        reregistered: tuple[str, ...] = (),
    ) -> CallRecord:
        """Record that the server answered ``prepared`` with ``completion`` (``dropped``:
        what was mirrored before the request was sent; ``lost_session``: the session the
        call found lost; ``reregistered``: the skills registered again on its worker)."""
        plan = prepared.plan
        if prepared.leyline is not None:
            self.answered = True
        sent = plan.directives if prepared.leyline is not None else ()
        leyline = _leyline_of(completion) if prepared.leyline is not None else None
        scratched = self.planner.commit(plan, leyline if self.directives else None)
        usage = getattr(completion, "usage", None)
        prompt = _int_attr(usage, "prompt_tokens")
        generated = _int_attr(usage, "completion_tokens")
        self._reply = None
        if leyline is not None and self.directives and generated is not None:
            # Spans dropped at the end of the turn moved the reply (the spans reported are
            # after the drop, the token counts before it).
            moved = sum(d.replacement_tokens - d.tokens for d in scratched)
            self._reply = _reply_of(completion, plan, leyline, generated + moved)
        record = CallRecord(
            call=len(self.records),
            session=self.session if prepared.leyline is not None else None,
            leyline=support.leyline,
            path=leyline.path.value if leyline else None,
            reused_tokens=leyline.reused_tokens if leyline else None,
            prefilled_tokens=leyline.prefilled_tokens if leyline else None,
            rotated_tokens=leyline.rotated_tokens if leyline else None,
            fallback_reason=leyline.fallback_reason.value
            if leyline and leyline.fallback_reason
            else None,
            latency_s=latency_s,
            messages=len(plan.messages),
            edits=len(plan.edits),
            directives=len(sent),
            plan_fallback=plan.fallback,
            resync=resync,
            revision=leyline.revision if leyline else None,
            prompt_tokens=prompt,
            completion_tokens=generated,
            composed=tuple(block.skill for block in leyline.composed) if leyline else (),
            skill_notes=plan.skill_notes,
            verbs=tuple(str(d.verb) for d in sent),
            cleared_tokens=plan.cleared_tokens,
            cleared_tool_uses=plan.cleared_tool_uses,
            streamed=streamed,
            new_conversation=new_conversation,
            dropped=(*dropped, *scratched),
            lost_session=lost_session,
            reregistered=reregistered,
        )
        self.records.append(record)
        self.last_plan = plan
        return record

    def mirror(self, info: SessionInfo) -> tuple[Dropped, ...] | None:
        """The session as ``GET /leyline/v1/sessions/{id}`` read it after a
        ``revision_conflict``: mirror the decay spans it dropped (see
        :meth:`TurnPlanner.mirror`). None: nothing to mirror (the caller resyncs)."""
        found = self.planner.mirror(info.dropped, info.revision, info.spans)
        if found and self._reply is not None:
            moved = sum(d.replacement_tokens - d.tokens for d in found)
            reply = self._reply
            self._reply = _Reply(reply.message, reply.start + moved, reply.end + moved)
        return found

    def drop(self) -> None:
        """The server's cache is not what the planner thinks (conflict, error): the next
        call sends plain messages in the session; the server re-prefills."""
        self.planner.drop_session()
        self._reply = None

    def renew(self) -> str:
        """The server lost the session: drop what it held, go on in a new session (the
        first id with ``~n``, n counting losses; a fresh id where that would be longer than
        a session id may be). Returns the lost id."""
        lost = self.session
        self.drop()
        self.losses += 1
        renewed = f"{self._origin}~{self.losses}"
        self.session = renewed if len(renewed) <= MAX_SESSION_ID else new_session_id()
        self.answered = False
        return lost

    def _reply_sent(self, messages: Sequence[Message]) -> bool:
        """Whether the agent sent the last reply back as a new message."""
        assert self._reply is not None
        pairs = align_messages(self.planner.served, messages)
        fresh = [messages[j] for o, j in pairs if o is None and j is not None]
        return any(same_reply(m, self._reply.message) for m in fresh)

    @staticmethod
    def _drop_reply(reply: _Reply) -> SpliceDirective:
        """Remove the unsent reply (and its generation prompt) from the cached tail.

        Without it the request's messages would not be the cached sequence with the batch
        applied (spec section 6: ``token_mismatch``), since the reply is still cached.
        """
        return SpliceDirective(span=TokenSpan(start=reply.start, end=reply.end))


def continues(previous: Sequence[Message], messages: Sequence[Message]) -> bool:
    """Whether ``messages`` carry on the conversation whose last request was ``previous``.

    The task (the first user message of ``previous``) must still be there, and either the
    conversation opens with the same message (system prompt) as before, or a reply of the
    previous conversation is still there (an agent that keeps its state in the system
    prompt and edits it). Anything else, such as the same agent on another task, or another
    agent on the same task from scratch, is a new conversation. Messages may be inserted,
    edited or dropped around those (diff mode).
    """
    if not previous:
        return True
    keys = {message_key(m) for m in messages}
    task = next((m for m in previous if m.get("role") == "user"), None)
    if task is not None and message_key(task) not in keys:
        return False
    if messages and message_key(previous[0]) == message_key(messages[0]):
        return True
    replies = {message_key(m) for m in previous if m.get("role") == "assistant"}
    return any(message_key(m) in replies for m in messages if m.get("role") == "assistant")


class Conversations:
    """The episodes of one wrapper, one per conversation (see :func:`continues`).

    A call that carries on an earlier conversation continues its episode (the agent may have
    appended to or rewritten its list: diff mode); any other call gets a new episode on a
    new session, so no directive ever splices one conversation's cache into another's. The
    ``limit`` most recently used episodes are kept; older ones are handed back, for their
    sessions to be closed. ``detect=False``: every call continues the one episode.
    """

    def __init__(
        self,
        make_planner: Callable[[], TurnPlanner],
        session: str | None,
        *,
        directives: bool = True,
        detect: bool = True,
        limit: int = 8,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.make_planner, self.directives = make_planner, directives
        self.detect, self.limit = detect, limit
        self.records: list[CallRecord] = []
        self.current = self._new(session or new_session_id())
        self._episodes: list[Episode] = [self.current]  # least recently used first

    @property
    def episodes(self) -> tuple[Episode, ...]:
        return tuple(self._episodes)

    def route(self, messages: Sequence[Message]) -> tuple[Episode, list[Episode], bool]:
        """The episode for a call with ``messages``, the episodes evicted to make room (their
        sessions are to be closed), and whether the call opens a new conversation."""
        if not self.detect:
            return self.current, [], False
        candidates = [self.current, *reversed(self._episodes)]
        found = next((e for e in candidates if continues(e.planner.agent, messages)), None)
        if found is not None:
            self._episodes.remove(found)
            self._episodes.append(found)
            self.current = found
            return found, [], False
        episode = self._new(new_session_id())
        self._episodes.append(episode)
        evicted = self._episodes[: -self.limit]
        del self._episodes[: -self.limit]
        self.current = episode
        return episode, evicted, True

    def _new(self, session: str) -> Episode:
        planner = self.make_planner()
        return Episode(planner, session, directives=self.directives, records=self.records)


def same_reply(a: Message, b: Message) -> bool:
    """Two assistant messages a server renders alike: same text and same tool calls."""
    if a.get("role") != "assistant" or b.get("role") != "assistant":
        return False
    return (content_text(a) or "") == (content_text(b) or "") and _calls(a) == _calls(b)


def _calls(message: Message) -> str:
    calls = message.get("tool_calls") or []
    out: list[object] = []
    for call in calls if isinstance(calls, list | tuple) else []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            out.append(call)
            continue
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = arguments
        out.append([function.get("name"), parsed])
    return canonical_json(out)


MAX_SESSION_ID = 128
"""The longest session id the protocol takes (``LeylineRequest.session``)."""


def new_session_id() -> str:
    return f"leyline-{uuid.uuid4().hex[:16]}"


def _required(request: LeylineRequest, required: bool) -> LeylineRequest:
    """``request`` with ``options.require_session`` set when ``required``."""
    if not required:
        return request
    options = request.options.model_copy(update={"require_session": True})
    return request.model_copy(update={"options": options})


def _leyline_of(completion: BaseModel) -> LeylineResponse | None:
    data = (completion.model_extra or {}).get(LEYLINE_KEY)
    if data is None:
        return None
    try:
        return LeylineResponse.model_validate(data)
    except ValidationError:
        return None


def _reply_of(
    completion: BaseModel, plan: TurnPlan, leyline: LeylineResponse, generated: int
) -> _Reply | None:
    sent = len(plan.messages)
    if not sent or len(leyline.spans) < sent:
        return None
    choices = getattr(completion, "choices", None) or []
    message = getattr(choices[0], "message", None) if choices else None
    if not isinstance(message, BaseModel):
        return None
    start = leyline.spans[sent - 1].end
    end = leyline.reused_tokens + leyline.prefilled_tokens + generated
    if end <= start:
        return None
    return _Reply(message.model_dump(mode="json", exclude_none=True), start, end)


def _int_attr(value: object, name: str) -> int | None:
    found = getattr(value, name, None)
    return found if isinstance(found, int) else None
