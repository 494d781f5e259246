"""Walk an alignment of two message lists and build the directives that realise it.

Used by :mod:`.translate`, which states the rules and re-exports the public names
(:data:`Addressing`, :data:`Render`, :data:`EditDirective`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from leyline.protocol import (
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

Addressing = Literal["auto", "anchor", "token"]
"""``anchor``: message anchors the server resolves; ``token``: token spans from the reported
spans; ``auto``: token spans when spans are known, else anchors."""

Render = Callable[[Sequence[Message]], TokenizeResponse]
"""Tokens and message spans of a message list as the server renders it, e.g.
``lambda ms: client.tokenize(messages=list(ms))``."""

EditDirective = SpliceDirective | ForgetDirective | ErratumDirective


@dataclass(frozen=True, slots=True)
class _Group:
    """Old messages ``[a, b)`` replaced by new messages ``[c, d)``."""

    a: int
    b: int
    c: int
    d: int


class Unexpressible(Exception):
    """The change needs something the client does not have (spans, the server's rendering)."""


def check_alignment(pairs: Sequence[Pair], old: int, new: int) -> None:
    olds = [o for o, _ in pairs if o is not None]
    news = [j for _, j in pairs if j is not None]
    if olds != list(range(old)) or news != list(range(new)):
        raise ValueError("an alignment must list every old and new message once, in order")


class DirectiveBuilder:
    """One batch: content splices for changed messages, span splices for message groups.

    The old spans and the new rendering are fetched at most once, and only when a change
    needs them; a change that needs what is missing raises :class:`Unexpressible`.
    """

    def __init__(
        self,
        old: Sequence[Message],
        new: Sequence[Message],
        spans: Sequence[MessageSpan],
        render: Render | None,
        use_tokens: bool,
        forget: frozenset[int],
    ) -> None:
        self.old, self.new, self.spans, self.render = old, new, spans, render
        self.use_tokens, self.forget = use_tokens, forget
        self._old_spans: Sequence[MessageSpan] | None = spans or None
        self._new_render: TokenizeResponse | None = None
        self._old_render: TokenizeResponse | None = None

    def build(self, pairs: Sequence[Pair]) -> tuple[list[EditDirective], int]:
        directives: list[EditDirective] = []
        run_old: list[int] = []
        run_new: list[int] = []
        consumed = 0  # old messages walked past so far
        appended = 0

        def flush(last: bool = False) -> None:
            nonlocal appended
            a = consumed - len(run_old)
            if last and run_new:  # new messages at the end extend the session: no directive
                appended = len(run_new)
                run_new.clear()
            if run_old or run_new:
                c = run_new[0] if run_new else 0
                directives.extend(self._group(_Group(a, consumed, c, c + len(run_new))))
            run_old.clear()
            run_new.clear()

        for o, j in pairs:
            if o is not None and j is not None:
                if same_rendering(self.old[o], self.new[j]):
                    flush()
                    consumed += 1
                    continue
                if self._content_editable(o, j):
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

    def _group(self, g: _Group) -> list[EditDirective]:
        if g.c == g.d and not self.use_tokens:  # deletions: anchors the server resolves
            return [
                self._mode(range(k, k + 1))(span=MessageAnchor(message=k)) for k in range(g.a, g.b)
            ]
        verb = self._mode(range(g.a, g.b))  # one span: FORGET if any message asks for it
        if g.c < g.d:
            self._rendered_new()  # the reason to name first when nothing can render
        start, end = _region(self._spans_old(), g.a, g.b)
        tokens: list[int] = []
        if g.c < g.d:
            rendered = self._rendered_new()
            lo, hi = _region(rendered.spans, g.c, g.d)
            tokens = list(rendered.tokens[lo:hi])
        if start == end and not tokens:
            return []
        return [verb(span=TokenSpan(start=start, end=end), replacement=tokens or "")]

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
