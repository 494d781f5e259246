"""Render chat messages with the model's own template, and find each message's tokens.

Every response reports message -> token spans so clients can address edits precisely. The
spans come from one rendering: each message's character range is where the rendering of
``messages[:k+1]`` extends that of ``messages[:k]``; the tokenizer's offsets map characters
to tokens (by bisection). Found in linear time when each message renders on its own (what
it adds after message 0 alone tiles the full text, checked), else by rendering every prefix
(quadratic). A template whose renderings are not prefixes of each other gets no spans (the
server still works; anchors then fail with ``unresolved_anchor``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from leyline.core.chat.tool_format import render_tool_calls, render_tools
from leyline.core.openai_types import ChatMessage, ToolSpec
from leyline.protocol import ErrorCode, LeylineError, MessageSpan, TokenSpan

if TYPE_CHECKING:  # a type only: the SGLang backend imports this without transformers
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class Rendered:
    """Messages rendered with the backend's chat template."""

    tokens: tuple[int, ...]
    spans: tuple[MessageSpan, ...]


@dataclass(frozen=True, slots=True)
class RenderedChat:
    text: str
    tokens: tuple[int, ...]
    spans: tuple[MessageSpan, ...]


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or it refused these messages."""

    def answer(self) -> LeylineError:
        """How a server answers it: ``invalid_directive`` on ``messages``."""
        return LeylineError(ErrorCode.invalid_directive, str(self), "messages")


class BackendRenderer:
    """A backend's chat rendering (``Backend.renderer``): ``ChatRenderer`` over its tokenizer,
    made on first use (``eager``: now, so a tokenizer without a template fails here).
    Without a tokenizer, or when the template refuses, the request is ``invalid_directive``
    on ``messages``; ``missing`` says why there is no tokenizer."""

    def __init__(self, tokenizer: Any | None, missing: str, *, eager: bool = False) -> None:
        self.tokenizer = tokenizer
        self.missing = missing
        self._renderer = ChatRenderer(tokenizer) if eager and tokenizer is not None else None

    def chat_renderer(self) -> ChatRenderer:
        if self.tokenizer is None:
            raise LeylineError(ErrorCode.invalid_directive, self.missing, "messages")
        if self._renderer is None:
            try:
                self._renderer = ChatRenderer(self.tokenizer)
            except ChatTemplateError as exc:
                raise exc.answer() from None
        return self._renderer

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] | None,
        *,
        add_generation_prompt: bool,
    ) -> Rendered:
        renderer = self.chat_renderer()
        try:
            out = renderer.render(messages, tools, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            raise exc.answer() from None
        return Rendered(out.tokens, out.spans)


class ChatRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template; use /v1/completions")
        self.tokenizer = tokenizer

    def template_messages(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None = None
    ) -> list[dict[str, str]]:
        """Plain ``{role, content}`` dicts; tool calls and tool lists rendered as text."""
        out: list[dict[str, str]] = []
        for message in messages:
            content = message.text()
            if message.tool_calls:
                calls = render_tool_calls(message.tool_calls)
                content = f"{content}\n{calls}" if content else calls
            role = "system" if message.role == "developer" else message.role
            out.append({"role": role, "content": content})
        if tools:
            block = render_tools(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises many types; the message is what matters
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
        return str(text)

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> RenderedChat:
        plain = self.template_messages(messages, tools)
        # A tool list inserted as its own system message belongs to message 0's span.
        shift = len(plain) - len(messages)
        text = self.render_text(plain, add_generation_prompt)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        tokens = tuple(int(t) for t in encoded["input_ids"])
        offsets = _Offsets([tuple(o) for o in encoded["offset_mapping"]])
        bounds = self._message_bounds(plain, text)
        spans: list[MessageSpan] = []
        if bounds is not None:
            for index, message in enumerate(messages):
                lo = bounds[0] if index == 0 else bounds[index + shift]
                hi = bounds[index + shift + 1]
                spans.append(
                    self._span(index, message, plain[index + shift], text, lo, hi, offsets)
                )
        return RenderedChat(text, tokens, tuple(spans))

    def _message_bounds(self, plain: list[dict[str, str]], text: str) -> list[int] | None:
        """Character offsets where each message starts, plus the end of the last."""
        if not plain:
            return [0]
        return self._bounds_by_pieces(plain, text) or self._bounds_by_prefixes(plain, text)

    def _bounds_by_pieces(self, plain: list[dict[str, str]], text: str) -> list[int] | None:
        """Linear: message k's piece is what it adds after message 0 alone; the pieces must
        tile ``text`` exactly. Templates whose rendering of a message depends on more than
        itself and the first message fail the check and go to the prefix method."""
        first = self.render_text(plain[:1], add_generation_prompt=False)
        if not text.startswith(first):
            return None
        bounds = [0, len(first)]
        for message in plain[1:]:
            pair = self.render_text([plain[0], message], add_generation_prompt=False)
            piece = pair[len(first) :]
            if not pair.startswith(first) or not piece or not text.startswith(piece, bounds[-1]):
                return None
            bounds.append(bounds[-1] + len(piece))
        return bounds

    def _bounds_by_prefixes(self, plain: list[dict[str, str]], text: str) -> list[int] | None:
        """Quadratic: the rendering of ``plain[:k]`` must be a prefix of ``text``."""
        bounds = [0]
        for k in range(1, len(plain) + 1):
            prefix = self.render_text(plain[:k], add_generation_prompt=False)
            if not text.startswith(prefix) or len(prefix) < bounds[-1]:
                return None
            bounds.append(len(prefix))
        return bounds

    def _span(
        self,
        index: int,
        message: ChatMessage,
        plain: dict[str, str],
        text: str,
        lo: int,
        hi: int,
        offsets: _Offsets,
    ) -> MessageSpan:
        segment = text[lo:hi]
        content = tool_calls = None
        body = message.text()
        if body and (at := segment.rfind(body)) >= 0:
            content = offsets.tokens_in(lo + at, lo + at + len(body))
        if message.tool_calls:
            rendered = render_tool_calls(message.tool_calls)
            if (at := segment.rfind(rendered)) >= 0:
                tool_calls = offsets.tokens_in(lo + at, lo + at + len(rendered))
        whole = offsets.tokens_in(lo, hi)
        return MessageSpan(
            message=index,
            role=plain["role"],
            start=whole.start,
            end=whole.end,
            content=content,
            tool_calls=tool_calls,
        )


class _Offsets:
    """Token character offsets, searched by bisection when their starts are sorted (they are
    for a plain left-to-right tokenization; anything else is searched linearly)."""

    def __init__(self, offsets: list[tuple[int, int]]) -> None:
        self.offsets = offsets
        self.starts = [a for a, _ in offsets]
        self.ordered = all(x <= y for x, y in zip(self.starts, self.starts[1:], strict=False))

    def tokens_in(self, lo: int, hi: int) -> TokenSpan:
        """Tokens whose characters start in ``[lo, hi)`` (a token straddling ``lo`` belongs
        before; zero-width tokens never start a span)."""
        offsets, n = self.offsets, len(self.offsets)
        if self.ordered:
            start = bisect.bisect_left(self.starts, lo)
            while start < n and offsets[start][1] <= offsets[start][0]:
                start += 1
            end = bisect.bisect_left(self.starts, hi)
        else:
            start = next((i for i, (a, b) in enumerate(offsets) if a >= lo and b > a), n)
            end = next((i for i, (a, _) in enumerate(offsets) if a >= hi), n)
        return TokenSpan(start=start, end=max(start, end))
