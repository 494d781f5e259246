"""A deterministic TOY renderer and tokenizer of chat messages, for tests only.

It is not any real chat template or tokenizer. One token per character (``ord``); a message
renders as ``<role> <name/tool_call_id chars> <sep> <content chars> <tool_calls JSON chars>
<end>`` with special tokens above the character range, after one ``<bos>`` token that
belongs to no message. Spans are reported the way a Leyline server reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

from leyline.policies.messages import Message, canonical_json, content_text
from leyline.protocol import MessageSpan, TokenSpan
from leyline.protocol.resources import TokenizeResponse

SPECIAL = 0x110000  # above every Unicode code point
BOS, SEP, END = SPECIAL, SPECIAL + 1, SPECIAL + 2
ROLE = {
    r: SPECIAL + 10 + k for k, r in enumerate(["system", "developer", "user", "assistant", "tool"])
}


def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def render(messages: Sequence[Message]) -> TokenizeResponse:
    tokens: list[int] = [BOS]
    spans: list[MessageSpan] = []
    for index, message in enumerate(messages):
        start = len(tokens)
        tokens.append(ROLE.get(str(message.get("role")), SPECIAL + 9))
        tokens += tokenize(str(message.get("name") or message.get("tool_call_id") or ""))
        tokens.append(SEP)
        text = content_text(message)
        if text is None:
            text = canonical_json(message.get("content"))
        content = TokenSpan(start=len(tokens), end=len(tokens) + len(text))
        tokens += tokenize(text)
        calls = None
        if message.get("tool_calls"):
            rendered = canonical_json(message.get("tool_calls"))
            calls = TokenSpan(start=len(tokens), end=len(tokens) + len(rendered))
            tokens += tokenize(rendered)
        tokens.append(END)
        spans.append(
            MessageSpan(
                message=index,
                role=str(message.get("role")),
                start=start,
                end=len(tokens),
                content=content if text else None,
                tool_calls=calls,
            )
        )
    return TokenizeResponse(tokens=tokens, spans=spans)


GAP = SPECIAL + 3


def render_with_gaps(messages: Sequence[Message]) -> TokenizeResponse:
    """:func:`render` with a separator token between messages that belongs to no span."""
    plain = render(messages)
    tokens: list[int] = [BOS]
    spans: list[MessageSpan] = []
    for span in plain.spans:
        if spans:
            tokens.append(GAP)
        shift = len(tokens) - span.start

        def moved(part: TokenSpan | None, shift: int = shift) -> TokenSpan | None:
            return (
                None if part is None else TokenSpan(start=part.start + shift, end=part.end + shift)
            )

        tokens += plain.tokens[span.start : span.end]
        spans.append(
            MessageSpan(
                message=span.message,
                role=span.role,
                start=span.start + shift,
                end=span.end + shift,
                content=moved(span.content),
                tool_calls=moved(span.tool_calls),
            )
        )
    return TokenizeResponse(tokens=tokens, spans=spans)
