"""The pure core of the middleware: what to send each turn, and what was served.

The agent owns its message list and may rewrite it (diff mode); the policy's edits are a
log replayed onto that list each turn. A logged edit of a message the agent has since
changed is dropped: the agent's own change wins.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from leyline.protocol import LeylineRequest, LeylineResponse, MessageSpan, Mode, TokenSpan
from leyline.protocol.envelope import DroppedSpan

from .align import align_messages
from .base import Policy, Summarizer, run_policy
from .counting import TokenCounter, default_counter, message_tokens
from .edits import (
    AppendErratum,
    AppliedEdits,
    DropMessages,
    KeepServed,
    MarkSpan,
    PolicyEdit,
    ReplaceContent,
    ReplaceMessage,
    apply_to_messages,
    readdress,
)
from .errors import TranscriptError
from .messages import Message, canonical_json, message_key, with_content
from .registry import PolicyConfig, parse_policy
from .retention_marks import Dropped, MarkDirective, SentMark, mark_directives, match_drops
from .skill_refs import SkillLookup, skill_blocks, wire_message
from .transcript import Transcript
from .translate import Addressing, EditDirective, Render, plan_directives

Pinned = Callable[[int, Message], bool]
"""``pinned(index, message)``: whether the agent's message ``index`` is pinned."""


@dataclass(frozen=True, slots=True)
class TurnPlan:
    messages: tuple[Message, ...]
    """The messages to send: the agent's, with the policy's edits applied (and without the
    side field of skill messages, which is for the planner only)."""
    directives: tuple[EditDirective | MarkDirective, ...]
    base_revision: int | None
    """The cached revision the directives address (None when nothing is cached)."""
    edits: tuple[PolicyEdit, ...]
    """What the policy proposed this turn (indices into ``messages`` before these edits)."""
    fallback: str | None = None
    """Why the edits go as plain messages (the server re-prefills) instead of directives."""
    agent: tuple[Message, ...] = field(default=(), repr=False)
    log: tuple[PolicyEdit, ...] = field(default=(), repr=False)
    skill_notes: tuple[str, ...] = ()
    """Why new skill messages went as text rather than as composes."""
    tail_replaced: bool = False
    """The directives replace the cached tail given to :meth:`TurnPlanner.plan`."""
    cleared_tokens: int = 0
    """Tokens this turn's edits took out of the context (net: a summary's own tokens are
    subtracted), counted with the planner's counter."""
    cleared_tool_uses: tuple[str, ...] = ()
    """Tool calls (ids) whose output or arguments this turn's edits cleared or removed."""
    marks: tuple[SentMark, ...] = ()
    """The ``pin``, ``decay`` and ``scratch`` directives among ``directives``: which sent
    message each one marks."""
    check_revision: bool = False
    """Send ``base_revision`` even without directives: the server may have dropped decay
    spans since, and must then answer ``revision_conflict`` instead of re-prefilling."""

    def leyline(self, session: str | None = None) -> LeylineRequest:
        """The ``leyline`` object of the chat request (``extra_body={"leyline": ...}``)."""
        if not self.directives:
            if self.check_revision and self.base_revision is not None:
                return LeylineRequest(session=session, base_revision=self.base_revision)
            return LeylineRequest(session=session)
        return LeylineRequest(
            session=session, base_revision=self.base_revision, directives=list(self.directives)
        )


class TurnPlanner:
    """Turns an agent's message list into what to send, turn after turn. No I/O::

        plan = planner.plan(agent_messages)           # policy edits + directives
        response = client.chat.completions.create(
            messages=plan.messages, extra_body={"leyline": plan.leyline(session).model_dump()})
        planner.commit(plan, leyline_response)         # only once the server answered

    Nothing changes before :meth:`commit`, so a failed request leaves the planner as it was
    (retry, or :meth:`drop_session` and re-prefill).

    ``skills`` looks up skill messages (see :mod:`.skills`); with it and ``render``, a new
    skill message is composed (the server inserts its precomputed KV) instead of prefilled.
    """

    def __init__(
        self,
        policy: PolicyConfig | None = None,
        *,
        counter: TokenCounter | None = None,
        render: Render | None = None,
        addressing: Addressing = "auto",
        pinned: Pinned | None = None,
        skills: SkillLookup | None = None,
        summarizer: Summarizer | None = None,
    ) -> None:
        self.policy: Policy | None = parse_policy(policy) if policy is not None else None
        self.counter, self.render, self.addressing = counter, render, addressing
        self.pinned, self.skills, self.summarizer = pinned, skills, summarizer
        self._agent: tuple[Message, ...] = ()
        self._log: tuple[PolicyEdit, ...] = ()
        self._served: tuple[Message, ...] = ()
        self._spans: tuple[MessageSpan, ...] = ()
        self._revision: int | None = None
        self.retention = False
        """The server executes ``pin``, ``decay`` and ``scratch`` (the wrappers set it per
        call): pins go as directives, and policies may mark spans instead of clearing."""
        self._pinned: set[str] = set()
        """Served messages (keys) pinned on the server."""
        self._decaying: dict[str, SentMark] = {}
        """Served messages (keys) marked ``decay`` on the server, not yet dropped."""

    @property
    def decaying(self) -> bool:
        """Decay marks are out: the server may drop their spans at any time."""
        return bool(self._decaying) and self._revision is not None

    @property
    def revision(self) -> int | None:
        return self._revision

    @property
    def served(self) -> tuple[Message, ...]:
        return self._served

    @property
    def agent(self) -> tuple[Message, ...]:
        """The agent's messages of the last committed turn (before the policy's edits)."""
        return self._agent

    def plan(
        self,
        messages: Sequence[Message],
        *,
        tail: TokenSpan | None = None,
        replace_tail: bool = False,
    ) -> TurnPlan:
        """What to send for the agent's ``messages``.

        ``tail`` is what the cache holds after the last served message (the generation
        prompt and the last reply), when known: a skill composed after the served messages
        replaces it with the messages before the skill. ``replace_tail``: its reply was not
        sent back; a batch with edits replaces it with the first appended message (see
        :func:`~.translate.plan_directives`).

        Raises:
            TranscriptError: the agent's messages are not a valid transcript.
            PolicyEditError: the policy broke a rule (edited a pinned message, ...).
        """
        agent = tuple(messages)
        log, base, view = self._view(agent)
        marking = self.retention and self._revision is not None
        edits: list[PolicyEdit] = []
        if self.policy is not None:
            edits = run_policy(
                self.policy,
                view,
                counter=self.counter,
                served=self._served,
                summarizer=self.summarizer,
                retention=marking,
            )
        cleared_tokens, cleared_uses = self._cleared(view, edits)
        name = self.policy.type if self.policy is not None else "<none>"
        mapped = [_anchor_note(readdress(e, base.source, name), len(agent)) for e in edits]
        # A new edit of a message supersedes a logged one; KeepServed lasts this request only.
        changed = {
            e.message for e in mapped if isinstance(e, ReplaceContent | ReplaceMessage | KeepServed)
        }
        changed |= {i for e in mapped if isinstance(e, DropMessages) for i in e.messages}
        kept = tuple(
            e
            for e in log
            if not (isinstance(e, ReplaceContent | ReplaceMessage) and e.message in changed)
        )
        new_log = kept + tuple(e for e in mapped if not isinstance(e, KeepServed | MarkSpan))
        transient = [e for e in mapped if isinstance(e, KeepServed)]
        marks = [e for e in mapped if isinstance(e, MarkSpan)]
        final = apply_to_messages(agent, [*new_log, *transient])
        sent = tuple(wire_message(m) for m in final.messages)
        if self._revision is None:  # nothing cached: no directives, nothing to compose into
            return TurnPlan(
                sent,
                (),
                None,
                tuple(edits),
                agent=agent,
                log=new_log,
                cleared_tokens=cleared_tokens,
                cleared_tool_uses=cleared_uses,
            )
        blocks = skill_blocks(final.messages, self.skills) if self.skills else None
        result = plan_directives(
            self._served,
            sent,
            spans=self._spans,
            render=self.render,
            addressing=self.addressing,
            forget=self._forget(agent, new_log, sent, final.source),
            skills=blocks,
            tail=tail,
            replace_tail=replace_tail,
        )
        directives: tuple[EditDirective | MarkDirective, ...] = result.directives
        sent_marks: tuple[SentMark, ...] = ()
        if marking and result.fallback is None:
            pins = {s for v in view.pinned if (s := base.source[v]) is not None}
            sent_marks = mark_directives(
                served=self._served,
                sent=sent,
                source=final.source,
                spans=self._spans,
                edits=result.directives,
                pins=sorted(pins),
                pin_ttl_s=self.policy.pin_ttl_s() if self.policy is not None else None,
                marks=marks,
                pinned_before=self._pinned,
                decaying=self._decaying,
            )
            directives = (*directives, *(m.directive for m in sent_marks))
        return TurnPlan(
            messages=sent,
            directives=directives,
            base_revision=self._revision,
            edits=tuple(edits),
            fallback=result.fallback,
            agent=agent,
            log=new_log,
            skill_notes=result.notes,
            tail_replaced=result.tail_replaced,
            cleared_tokens=cleared_tokens,
            cleared_tool_uses=cleared_uses,
            marks=sent_marks,
            check_revision=marking and bool(self._decaying),
        )

    def commit(
        self, plan: TurnPlan, response: LeylineResponse | None = None
    ) -> tuple[Dropped, ...]:
        """Record that ``plan`` was served; ``response`` is the server's ``leyline`` object
        (None from a server without Leyline: later plans then carry no directives).

        Spans the server dropped at the end of this turn (``scratch``) are mirrored: the
        message now holds the mark's replacement, in what was served and in the edit log,
        so the next request extends the session. Returns what was mirrored."""
        self._agent, self._log, self._served = plan.agent, plan.log, plan.messages
        if response is None:
            self._revision, self._spans = None, ()
            self._pinned.clear()
            self._decaying.clear()
            return ()
        self._revision = response.revision
        # The revision may also hold the generated reply; address only what was sent.
        spans = tuple(response.spans)
        self._spans = spans[: len(plan.messages)] if len(spans) >= len(plan.messages) else ()
        for mark in plan.marks:
            if mark.verb == "pin":
                self._pinned.add(mark.key)
            elif mark.verb == "decay":
                self._decaying[mark.key] = mark
        scratches = sorted((m for m in plan.marks if m.verb == "scratch"), key=lambda m: m.message)
        base = plan.base_revision if plan.base_revision is not None else -1
        dropped = [d for d in response.dropped if d.verb == "scratch" and d.revision > base]
        if not scratches and not dropped:
            return ()
        if len(dropped) != len(scratches):  # not the drops asked for: start afresh
            self.drop_session()
            return ()
        for mark in scratches:
            self._replace_served(mark.message, mark.replacement, mark.mode)
        return tuple(
            Dropped(d.verb, m.message, d.revision, d.end - d.start, d.replacement_tokens)
            for m, d in zip(scratches, dropped, strict=True)
        )

    def mirror(
        self, dropped: Sequence[DroppedSpan], revision: int, spans: Sequence[MessageSpan]
    ) -> tuple[Dropped, ...] | None:
        """The server dropped decay spans (a session's ``dropped``, as ``GET
        /leyline/v1/sessions/{id}`` lists them, with its ``revision`` and ``spans``): put
        each mark's replacement in its message and address ``revision`` next, so the next
        request extends the session without a re-prefill. None (nothing changed) when the
        drops are not spans of messages this planner marked ``decay``."""
        if self._revision is None or len(self._spans) != len(self._served):
            return None
        news = [d for d in dropped if d.revision > self._revision]
        found = match_drops(news, self._spans, self._served, self._decaying)
        if not found:
            return None
        for index, mark, _ in found:
            self._replace_served(index, mark.replacement, mark.mode)
            self._decaying.pop(mark.key, None)
        self._revision = revision
        kept = tuple(spans)
        self._spans = kept[: len(self._served)] if len(kept) >= len(self._served) else ()
        return tuple(
            Dropped(d.verb, i, d.revision, d.end - d.start, d.replacement_tokens)
            for i, _, d in found
        )

    def drop_session(self) -> None:
        """Forget the server's cache (lost, or a revision conflict): the next plan sends plain
        messages and the server re-prefills. The policy's edits are kept."""
        self._revision, self._spans = None, ()
        self._pinned.clear()
        self._decaying.clear()

    def _replace_served(self, index: int, text: str, mode: Mode) -> None:
        """Served message ``index`` now holds ``text`` on the server: so it is served, and
        so the log makes it from the agent's message from now on."""
        message = with_content(self._served[index], text)
        self._served = (*self._served[:index], message, *self._served[index + 1 :])
        source = apply_to_messages(self._agent, self._log).source
        origin = source[index] if index < len(source) else None
        if origin is None:
            return
        others = tuple(
            e
            for e in self._log
            if not (isinstance(e, ReplaceContent | ReplaceMessage) and e.message == origin)
        )
        self._log = (*others, ReplaceContent(origin, text, mode, "dropped by the server"))

    def _view(
        self, agent: tuple[Message, ...]
    ) -> tuple[tuple[PolicyEdit, ...], AppliedEdits, Transcript]:
        """The logged edits replayed onto ``agent``: the transcript the policy sees."""
        log = self._replay(agent)
        base = apply_to_messages(agent, log)
        try:
            view = Transcript.from_messages(base.messages, pinned=self._pins(agent, base.source))
        except TranscriptError:
            Transcript.from_messages(agent)  # the agent's own list is at fault: say so
            log = tuple(e for e in log if not isinstance(e, DropMessages))  # a drop orphaned
            base = apply_to_messages(agent, log)
            view = Transcript.from_messages(base.messages, pinned=self._pins(agent, base.source))
        own = self.policy.pins(view) - view.pinned if self.policy is not None else frozenset()
        if own:  # the policy's own pins (``Pin``) hold for every policy, and on the server
            view = Transcript.from_messages(view.messages, pinned=view.pinned | own)
        return log, base, view

    def _replay(self, agent: tuple[Message, ...]) -> tuple[PolicyEdit, ...]:
        """The log, re-addressed from the agent's previous list to ``agent``."""
        pairs = [(o, j) for o, j in align_messages(self._agent, agent) if o is not None]
        same = {
            o: j
            for o, j in pairs
            if j is not None and message_key(self._agent[o]) == message_key(agent[j])
        }
        out: list[PolicyEdit] = []
        for edit in self._log:
            if isinstance(edit, ReplaceContent) and edit.message in same:
                out.append(ReplaceContent(same[edit.message], edit.text, edit.mode, edit.reason))
            elif isinstance(edit, ReplaceMessage) and edit.message in same:
                moved_to = same[edit.message]
                out.append(ReplaceMessage(moved_to, edit.replacement, edit.mode, edit.reason))
            elif isinstance(edit, DropMessages) and all(i in same for i in edit.messages):
                moved = tuple(same[i] for i in edit.messages)
                out.append(DropMessages(moved, edit.mode, edit.reason))
            elif isinstance(edit, AppendErratum):
                last = edit.after if edit.after is not None else len(self._agent) - 1
                after = max((j for o, j in pairs if j is not None and o <= last), default=-1)
                corrects = same.get(edit.corrects) if edit.corrects is not None else None
                out.append(AppendErratum(edit.text, corrects, edit.role, after, edit.reason))
        return tuple(out)

    def _cleared(
        self, view: Transcript, edits: Sequence[PolicyEdit]
    ) -> tuple[int, tuple[str, ...]]:
        """What ``edits`` (on ``view``) take out: net tokens, and the tool uses they clear."""
        if not any(isinstance(e, ReplaceContent | ReplaceMessage | DropMessages) for e in edits):
            return 0, ()
        counter = self.counter or default_counter()
        messages = view.messages
        tokens = 0
        uses: list[str] = []
        for edit in edits:
            if isinstance(edit, DropMessages):
                for i in edit.messages:
                    tokens += message_tokens(counter, messages[i])
                    uses += _tool_uses(messages[i], None)
            elif isinstance(edit, ReplaceContent | ReplaceMessage):
                old = messages[edit.message]
                new = (
                    with_content(old, edit.text)
                    if isinstance(edit, ReplaceContent)
                    else edit.replacement
                )
                tokens += message_tokens(counter, old) - message_tokens(counter, new)
                uses += _tool_uses(old, new)
        return tokens, tuple(dict.fromkeys(uses))

    def _pins(self, agent: Sequence[Message], source: Sequence[int | None]) -> list[int]:
        if self.pinned is None:
            return []
        pinned = self.pinned
        return [j for j, s in enumerate(source) if s is not None and pinned(s, agent[s])]

    def _forget(
        self,
        agent: Sequence[Message],
        log: Sequence[PolicyEdit],
        sent: Sequence[Message],
        source: Sequence[int | None],
    ) -> set[int]:
        """Served messages whose replacement or removal was asked for with FORGET."""
        replaced = {
            e.message
            for e in log
            if isinstance(e, ReplaceContent | ReplaceMessage) and e.mode is Mode.forget
        }
        dropped = {
            message_key(agent[i])
            for e in log
            if isinstance(e, DropMessages) and e.mode is Mode.forget
            for i in e.messages
        }
        forget: set[int] = set()
        for o, j in align_messages(self._served, sent):
            if o is None:
                continue
            gone = j is None and message_key(self._served[o]) in dropped
            if gone or (j is not None and source[j] in replaced):
                forget.add(o)
        return forget


def _tool_uses(old: Message, new: Message | None) -> list[str]:
    """Tool calls whose output (a tool message) or arguments (an assistant message) ``old``
    -> ``new`` clears; ``new`` None: ``old`` is removed."""
    if old.get("role") == "tool":
        call_id = old.get("tool_call_id")
        return [call_id] if isinstance(call_id, str) else []
    if old.get("role") != "assistant":
        return []
    kept = {_call_key(c) for c in _calls_of(new)} if new is not None else set()
    return [
        str(c.get("id"))
        for c in _calls_of(old)
        if _call_key(c) not in kept and isinstance(c.get("id"), str)
    ]


def _calls_of(message: Message) -> list[Mapping[str, object]]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list | tuple):
        return []
    return [c for c in calls if isinstance(c, Mapping)]


def _call_key(call: Mapping[str, object]) -> str:
    return canonical_json([call.get("id"), call.get("function")])


def _anchor_note(edit: PolicyEdit, length: int) -> PolicyEdit:
    """Notes appended now stay after the agent's current last message in later turns."""
    if isinstance(edit, AppendErratum) and edit.after is None:
        return AppendErratum(edit.text, edit.corrects, edit.role, length - 1, edit.reason)
    return edit
