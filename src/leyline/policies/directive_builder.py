"""Walk an alignment of two message lists and build the directives that realise it.

Used by :mod:`.translate`, which states the rules and re-exports the public names
(:data:`Addressing`, :data:`Render`, :data:`EditDirective`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from leyline.protocol import (
    ComposeDirective,
    ErratumDirective,
    ForgetDirective,
    MessageAnchor,
    MessageSpan,
    SpliceDirective,
    TokenSpan,
)
from leyline.protocol.resources import TokenizeResponse

from .align import Pair
from .messages import Message, content_text, same_rendering, shape_key
from .skill_refs import SkillBlock

Addressing = Literal["auto", "anchor", "token"]
"""``anchor``: message anchors the server resolves; ``token``: token spans from the reported
spans; ``auto``: token spans when spans are known, else anchors."""

Render = Callable[[Sequence[Message]], TokenizeResponse]
"""Tokens and message spans of a message list as the server renders it, e.g.
``lambda ms: client.tokenize(messages=list(ms))``."""

EditDirective = SpliceDirective | ForgetDirective | ErratumDirective | ComposeDirective


@dataclass(frozen=True, slots=True)
class _Group:
    """Old messages ``[a, b)`` replaced by new messages ``[c, d)``."""

    a: int
    b: int
    c: int
    d: int


class Unexpressible(Exception):
    """The change needs something the client does not have (spans, the server's rendering)."""


def _compose(block: SkillBlock, at: int) -> ComposeDirective:
    """The compose of ``block`` at token position ``at``: its seam, and its recompute when
    one was asked for (else the directive's default, so the wire JSON is the usual one)."""
    if block.recompute is None:
        return ComposeDirective(skill=block.skill, at=at, seam_tokens=block.seam_tokens)
    return ComposeDirective(
        skill=block.skill, at=at, seam_tokens=block.seam_tokens, recompute=block.recompute
    )


def check_alignment(pairs: Sequence[Pair], old: int, new: int) -> None:
    olds = [o for o, _ in pairs if o is not None]
    news = [j for _, j in pairs if j is not None]
    if olds != list(range(old)) or news != list(range(new)):
        raise ValueError("an alignment must list every old and new message once, in order")


class DirectiveBuilder:
    """One batch: content splices for changed messages, span splices for message groups,
    composes for new skill messages.

    The old spans and the new rendering are fetched at most once, and only when a change
    needs them; a change that needs what is missing raises :class:`Unexpressible`.

    ``skills`` (new message index -> block) are composed only when the block is exactly the
    message's tokens in the new rendering (so ``render`` is needed), and ``tail`` (the
    cached tokens after the old messages: generation prompt and reply) lets a skill among
    the appended messages replace that tail; without it appended skills go as text.
    ``replace_tail``: the tail's reply was not sent back, so the batch must take it out; the
    first appended message then replaces it rather than a plain deletion.
    """

    def __init__(
        self,
        old: Sequence[Message],
        new: Sequence[Message],
        spans: Sequence[MessageSpan],
        render: Render | None,
        use_tokens: bool,
        forget: frozenset[int],
        skills: Mapping[int, SkillBlock] | None = None,
        tail: TokenSpan | None = None,
        replace_tail: bool = False,
    ) -> None:
        self.old, self.new, self.spans, self.render = old, new, spans, render
        self.use_tokens, self.forget = use_tokens, forget
        self.skills: Mapping[int, SkillBlock] = skills if skills and render is not None else {}
        self.tail, self.replace_tail = tail, replace_tail
        self.notes: list[str] = []
        """Why a skill message went as text rather than as a compose."""
        self.tail_replaced = False
        """The batch replaces ``tail`` (then nothing else may delete it)."""
        self._old_spans: Sequence[MessageSpan] | None = spans or None
        self._new_render: TokenizeResponse | None = None
        self._old_render: TokenizeResponse | None = None
        self._checked_blocks: dict[int, bool] = {}

    def build(self, pairs: Sequence[Pair]) -> tuple[list[EditDirective], int]:
        directives: list[EditDirective] = []
        run_old: list[int] = []
        run_new: list[int] = []
        consumed = 0  # old messages walked past so far
        appended = 0

        def flush(last: bool = False) -> None:
            nonlocal appended
            a = consumed - len(run_old)
            tail_end = None
            if last and run_new:
                # New messages at the end extend the session (no directive), except those
                # that replace the cached tail: up to the last one composed, or the first
                # one when the batch edits anyway (see _trailing_group).
                sent = self._trailing_group(run_new, edits=bool(directives or run_old))
                appended = len(run_new) - sent
                del run_new[sent:]
                tail_end = self.tail.end if sent and self.tail is not None else None
            if run_old or run_new:
                c = run_new[0] if run_new else 0
                group = _Group(a, consumed, c, c + len(run_new))
                directives.extend(self._group(group, tail_end))
            run_old.clear()
            run_new.clear()

        for o, j in pairs:
            if o is not None and j is not None:
                if same_rendering(self.old[o], self.new[j]):
                    flush()
                    consumed += 1
                    continue
                if j not in self.skills and self._content_editable(o, j):
                    flush()
                    directives.extend(self._content(o, j))
                    consumed += 1
                    continue
            if o is not None:
                run_old.append(o)
                consumed += 1
            if j is not None:
                run_new.append(j)
        flush(last=True)
        return directives, appended

    def _mode(self, olds: range) -> type[SpliceDirective] | type[ForgetDirective]:
        return ForgetDirective if any(k in self.forget for k in olds) else SpliceDirective

    def _content_editable(self, o: int, j: int) -> bool:
        old, new = self.old[o], self.new[j]
        if shape_key(old) != shape_key(new):
            return False
        old_text, new_text = content_text(old), content_text(new)
        if not old_text or new_text is None:  # no content part to address, or not text
            return False
        return not self.use_tokens or self._spans_old()[o].content is not None

    def _content(self, o: int, j: int) -> list[EditDirective]:
        verb = self._mode(range(o, o + 1))
        if self.render is not None and self.use_tokens:
            return self._token_diff(o, j, verb)
        if self.render is not None:
            rendered = self._rendered_new()
            part = rendered.spans[j]
            tokens = list(rendered.tokens[part.start : part.end])
            return [verb(span=MessageAnchor(message=o, part="all"), replacement=tokens)]
        span: TokenSpan | MessageAnchor = MessageAnchor(message=o, part="content")
        if self.use_tokens:
            found = self._spans_old()[o].content
            assert found is not None  # checked by _content_editable
            span = found
        return [verb(span=span, replacement=content_text(self.new[j]) or "")]

    def _token_diff(
        self, o: int, j: int, verb: type[SpliceDirective] | type[ForgetDirective]
    ) -> list[EditDirective]:
        """The changed middle of message ``o``'s tokens, old vs new, as one token splice.

        Whole-message tokens rather than the content span: a template may merge the
        content's leading whitespace into the header's last token, out of a content span's
        reach. Unchanged leading and trailing tokens stay out of the span, so they are kept
        (and the trailing ones rotated), as a content splice would keep them.
        """
        before, after = self._rendered_old(), self._rendered_new()
        mine, theirs = before.spans[o], after.spans[j]
        old = before.tokens[mine.start : mine.end]
        new = after.tokens[theirs.start : theirs.end]
        head = 0
        while head < min(len(old), len(new)) and old[head] == new[head]:
            head += 1
        tail = 0
        while tail < min(len(old), len(new)) - head and old[-1 - tail] == new[-1 - tail]:
            tail += 1
        if head == len(old) == len(new):
            return []  # renders to the same tokens: nothing to splice
        at = self._spans_old()[o]
        span = TokenSpan(start=at.start + head, end=at.end - tail)
        return [verb(span=span, replacement=list(new[head : len(new) - tail]))]

    def _rendered_old(self) -> TokenizeResponse:
        assert self.render is not None
        if self._old_render is None:
            self._old_render = self.render(self.old)
            _checked(self._old_render.spans, len(self.old), "old")
        return self._old_render

    def _group(self, g: _Group, tail_end: int | None = None) -> list[EditDirective]:
        """Old messages ``[a, b)`` (through ``tail_end`` when given) -> new ``[c, d)``."""
        if g.c == g.d and not self.use_tokens:  # deletions: anchors the server resolves
            return [
                self._mode(range(k, k + 1))(span=MessageAnchor(message=k)) for k in range(g.a, g.b)
            ]
        verb = self._mode(range(g.a, g.b))  # one span: FORGET if any message asks for it
        if g.c < g.d:
            self._rendered_new()  # the reason to name first when nothing can render
        start, end = _region(self._spans_old(), g.a, g.b)
        if tail_end is not None:
            end, self.tail_replaced = tail_end, True
        head, composed = self._pieces(g)
        out: list[EditDirective] = []
        if start < end or head:
            out.append(verb(span=TokenSpan(start=start, end=end), replacement=head or ""))
        # Insertions at one point apply in batch order, after a span that ends there.
        for block, following in composed:
            out.append(_compose(block, end))
            if following:
                out.append(verb(span=TokenSpan(start=end, end=end), replacement=following))
        return out

    def _pieces(self, g: _Group) -> tuple[list[int], list[tuple[SkillBlock, list[int]]]]:
        """New messages ``[c, d)`` as tokens: those before the first composed skill, then
        each composed skill with the tokens that follow it up to the next one."""
        if g.c == g.d:
            return [], []
        rendered = self._rendered_new()
        # Where each message's tokens start, separators split as _region splits them.
        cuts = [_region(rendered.spans, g.c, k)[1] for k in range(g.c, g.d + 1)]
        head: list[int] = []
        composed: list[tuple[SkillBlock, list[int]]] = []
        current = head
        for k in range(g.c, g.d):
            piece = rendered.tokens[cuts[k - g.c] : cuts[k - g.c + 1]]
            block = self._block(k, piece)
            if block is None:
                current.extend(piece)
            else:
                current = []
                composed.append((block, current))
        return head, composed

    def _block(self, k: int, piece: Sequence[int]) -> SkillBlock | None:
        """New message ``k``'s skill, if its block is exactly the message's tokens here."""
        block = self.skills.get(k)
        if block is None:
            return None
        if k not in self._checked_blocks:
            self._checked_blocks[k] = tuple(piece) == block.tokens
            if not self._checked_blocks[k]:
                self.notes.append(
                    f"skill {block.skill!r} (message {k}): the server renders the message "
                    f"to other tokens here ({len(piece)}) than the skill holds "
                    f"({len(block.tokens)}); sent as text"
                )
        return block if self._checked_blocks[k] else None

    def _trailing_group(self, run: Sequence[int], *, edits: bool) -> int:
        """How many of the appended new messages ``run`` go in the batch, replacing the
        cached tail (generation prompt, reply).

        Through the last one composed, which needs the tail's place. Otherwise, when the
        tail's reply was not sent back (``replace_tail``) and the batch edits anyway
        (``edits``), so that the tail must go, the first one: it replaces the tail, and the
        server keeps the leading tokens the two share (the generation prompt and the start
        of the reply, spec section 4 rule 5), which a plain deletion would prefill again.
        Without edits the request extends the session and the server reuses the common
        prefix itself.
        """
        skills = [k for k in run if k in self.skills]
        if skills:
            sent = self._through_last_skill(run, skills)
            if sent:
                return sent
        if edits and self.replace_tail and self.render is not None:
            return 1 if self._tail_problem(run) is None else 0
        return 0

    def _through_last_skill(self, run: Sequence[int], skills: Sequence[int]) -> int:
        problem = self._tail_problem(run)
        if problem is not None:
            self.notes.append(f"appended skill messages go as text: the cached tail is {problem}")
            return 0
        rendered = self._rendered_new()
        for k in reversed(skills):  # run[0] > 0: message k's tokens start after k - 1's
            if self._block(k, rendered.tokens[rendered.spans[k - 1].end : rendered.spans[k].end]):
                return k - run[0] + 1
        return 0

    def _tail_problem(self, run: Sequence[int]) -> str | None:
        """Why the appended messages ``run`` cannot replace the cached tail (None: they can:
        it is known and starts where the old messages' tokens end)."""
        if self.tail is None or not self.old or run[0] == 0:
            return "unknown" if self.old and run[0] else "not after a cached message"
        if self._spans_old()[-1].end != self.tail.start:
            return "elsewhere"
        return None

    def _spans_old(self) -> Sequence[MessageSpan]:
        if self._old_spans is None:
            if self.render is None:
                raise Unexpressible(
                    "addressing whole messages by tokens needs the server's message spans "
                    "(or render=)"
                )
            self._old_spans = _checked(self.render(self.old).spans, len(self.old), "old")
        return self._old_spans

    def _rendered_new(self) -> TokenizeResponse:
        if self.render is None:
            raise Unexpressible(
                "messages were inserted or replaced whole; sending them as a splice needs the "
                "server's rendering (render=)"
            )
        if self._new_render is None:
            self._new_render = self.render(self.new)
            _checked(self._new_render.spans, len(self.new), "new")
        return self._new_render


def _region(spans: Sequence[MessageSpan], a: int, b: int) -> tuple[int, int]:
    """Tokens of messages ``[a, b)`` with the separators that go with them.

    A server's spans usually tile the rendering; where a template leaves tokens between
    messages, those before a message go with it, except that the first message takes the
    ones after it. Then removing or inserting whole messages keeps exactly one separator
    between neighbours. ``a == b`` is the insertion point before message ``a``.
    """
    if a > 0:
        return spans[a - 1].end, spans[b - 1].end if b > a else spans[a - 1].end
    if b == 0:
        return spans[0].start, spans[0].start
    return spans[0].start, spans[b].start if b < len(spans) else spans[b - 1].end


def _checked(spans: Sequence[MessageSpan], count: int, which: str) -> Sequence[MessageSpan]:
    if len(spans) != count:
        raise Unexpressible(
            f"the server's rendering of the {which} messages has {len(spans)} spans for "
            f"{count} messages (its template cannot be split per message)"
        )
    return spans
