"""Edits -> directives: anchors or token spans, text or token replacements, fallbacks."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from leyline.policies import (
    AppendErratum,
    DropMessages,
    ReplaceContent,
    edits_to_directives,
    infer_directives,
    plan_directives,
)
from leyline.policies.messages import Message
from leyline.protocol import (
    ErratumDirective,
    ForgetDirective,
    MessageAnchor,
    Mode,
    SpliceDirective,
    TokenSpan,
)
from leyline.protocol.resources import TokenizeResponse

from .toy_chat import render, tokenize
from .transcripts import episode, user

OLD = episode(2)  # system, user, assistant, tool, assistant, tool
SPANS = render(OLD).spans
STUB = ReplaceContent(3, "[evicted]")


def test_a_stub_is_a_content_splice_by_anchor_without_spans() -> None:
    plan = edits_to_directives(OLD, [STUB])
    assert plan.directives == (
        SpliceDirective(span=MessageAnchor(message=3, part="content"), replacement="[evicted]"),
    )
    assert plan.messages[3]["content"] == "[evicted]" and plan.appended == 0


def test_with_reported_spans_it_addresses_tokens_and_with_render_sends_tokens() -> None:
    plan = edits_to_directives(OLD, [STUB], spans=SPANS)
    assert plan.directives == (SpliceDirective(span=SPANS[3].content, replacement="[evicted]"),)
    # With the server's rendering, the changed middle of the message's tokens is sent (its
    # header may have absorbed leading whitespace of the content).
    (exact,) = edits_to_directives(OLD, [STUB], spans=SPANS, render=render).directives
    span = exact.span  # type: ignore[union-attr]
    assert isinstance(span, TokenSpan) and SPANS[3].start <= span.start <= span.end <= SPANS[3].end
    sent, stub = list(exact.replacement), list(tokenize("[evicted]"))  # type: ignore[union-attr, arg-type]
    assert any(sent[i : i + len(stub)] == stub for i in range(len(sent)))
    anchored = edits_to_directives(OLD, [STUB], spans=SPANS, addressing="anchor")
    assert anchored.directives[0].span == MessageAnchor(message=3, part="content")  # type: ignore[union-attr]


def test_spans_of_another_revision_are_not_used() -> None:
    plan = edits_to_directives(OLD, [STUB], spans=SPANS[:2])
    assert plan.directives[0].span == MessageAnchor(message=3, part="content")  # type: ignore[union-attr]


def test_drops_are_whole_message_anchors_or_one_token_span() -> None:
    drop = DropMessages((2, 3))
    assert edits_to_directives(OLD, [drop]).directives == (
        SpliceDirective(span=MessageAnchor(message=2)),
        SpliceDirective(span=MessageAnchor(message=3)),
    )
    (one,) = edits_to_directives(OLD, [drop], spans=SPANS).directives
    assert one == SpliceDirective(span=TokenSpan(start=SPANS[2].start, end=SPANS[3].end))


def test_each_edit_keeps_its_mode() -> None:
    edits = [ReplaceContent(3, "[gone]", Mode.forget), ReplaceContent(5, "[stub]")]
    directives = edits_to_directives(OLD, edits).directives
    assert [type(d) for d in directives] == [ForgetDirective, SpliceDirective]


def test_errata_are_appended_messages_or_erratum_directives() -> None:
    note = AppendErratum("[STATE UPDATE] x -> 1; overrides the earlier value.", corrects=0)
    as_message = edits_to_directives(OLD, [note])
    assert as_message.directives == () and as_message.appended == 1
    assert as_message.messages[-1] == {"role": "user", "content": note.text}
    as_directive = edits_to_directives(OLD, [note], errata="directive")
    assert as_directive.messages == tuple(OLD)
    assert as_directive.directives == (
        ErratumDirective(text=f"\n{note.text}\n", corrects=MessageAnchor(message=0)),
    )


def test_nothing_changed_and_pure_appends_need_no_directive() -> None:
    assert infer_directives(OLD, OLD).directives == ()
    plan = infer_directives(OLD, [*OLD, user("next")])
    assert plan.directives == () and plan.appended == 1 and plan.fallback is None


def test_inserted_messages_need_the_servers_rendering_or_fall_back() -> None:
    inserted = [*OLD[:2], user("an aside"), *OLD[2:]]
    plan = infer_directives(OLD, inserted, spans=SPANS)
    assert plan.directives == () and plan.fallback is not None
    assert "render=" in plan.fallback and plan.messages == tuple(inserted)
    (directive,) = infer_directives(OLD, inserted, spans=SPANS, render=render).directives
    assert directive.span == TokenSpan(start=SPANS[1].end, end=SPANS[1].end)  # type: ignore[union-attr]


def test_a_message_with_image_parts_is_replaced_whole() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    old: list[Message] = [OLD[0], image, OLD[1]]
    new: list[Message] = [OLD[0], {**image, "content": "described image"}, OLD[1]]
    assert infer_directives(old, new).fallback is not None
    assert infer_directives(old, new, render=render).directives[0].verb == "splice"


def test_a_template_that_cannot_be_split_per_message_falls_back() -> None:
    def no_spans(messages: Sequence[Message]) -> TokenizeResponse:
        return TokenizeResponse(tokens=render(messages).tokens, spans=[])

    plan = infer_directives(OLD, [*OLD[:2], user("aside"), *OLD[2:]], render=no_spans)
    assert plan.fallback is not None and "cannot be split per message" in plan.fallback


def test_a_malformed_alignment_is_rejected() -> None:
    with pytest.raises(ValueError, match="every old and new message once"):
        plan_directives(OLD, OLD, alignment=[(0, 0)])
