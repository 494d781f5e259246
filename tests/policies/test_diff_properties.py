"""Diff mode against the protocol's edit algebra, on random message lists.

Property: resolving the inferred directives against the old revision (the server's side:
``resolve_batch`` with the old spans) and applying them with ``apply_edits`` gives exactly
the tokens of the new message list, up to the messages the plan says are appended. The
renderer and tokenizer are the deterministic TOY ones of ``toy_chat`` (not a real template).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from leyline.policies import (
    AppendErratum,
    DirectivePlan,
    DropMessages,
    PolicyEdit,
    ReplaceContent,
    edits_to_directives,
    infer_directives,
)
from leyline.policies.messages import Message, content_text
from leyline.protocol import ForgetDirective, Mode, apply_edits, resolve_batch
from leyline.protocol.resources import TokenizeResponse

from .toy_chat import render, render_with_gaps, tokenize

TEXT = st.text(alphabet="ab \n", max_size=6)
IDS = st.sampled_from(["c1", "c2", "c3"])


@st.composite
def messages(draw: st.DrawFn) -> Message:
    role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
    message: dict[str, object] = {"role": role, "content": draw(st.none() | TEXT)}
    if role == "assistant" and draw(st.booleans()):
        name = draw(st.sampled_from(["view", "grep"]))
        message["tool_calls"] = [
            {"id": draw(IDS), "type": "function", "function": {"name": name, "arguments": "{}"}}
        ]
    if role == "tool":
        message["tool_call_id"] = draw(IDS)
    if draw(st.integers(0, 9)) == 0:
        message["content"] = [{"type": "text", "text": draw(TEXT)}]
    return message


@st.composite
def rewrite(draw: st.DrawFn, old: list[Message]) -> list[Message]:
    """The agent's new list: each old message kept, dropped, edited or replaced; insertions."""
    new: list[Message] = []
    for message in old:
        if draw(st.booleans()):
            new.append(draw(messages()))
        action = draw(st.sampled_from(["keep", "keep", "drop", "content", "replace"]))
        if action == "keep":
            new.append(message)
        elif action == "content":
            new.append({**message, "content": draw(TEXT)})
        elif action == "replace":
            new.append(draw(messages()))
    return new + draw(st.lists(messages(), max_size=3))


def check(
    old: Sequence[Message],
    new: Sequence[Message],
    plan: DirectivePlan,
    renderer: Callable[[Sequence[Message]], TokenizeResponse] = render,
) -> None:
    before, after = renderer(old), renderer(new)
    batch = resolve_batch(
        plan.directives, length=len(before.tokens), tokenize=tokenize, spans=before.spans
    )
    result = apply_edits(before.tokens, batch.edits)
    kept = len(new) - plan.appended  # appended messages extend the session after the batch
    if not plan.appended:
        cut = len(after.tokens)
    else:
        cut = after.spans[kept - 1].end if kept else after.spans[0].start
    assert list(result.tokens) == after.tokens[:cut]


@settings(max_examples=300, deadline=None)
@given(st.data(), st.lists(messages(), max_size=8), st.sampled_from(["auto", "anchor", "token"]))
def test_inferred_directives_turn_the_old_tokens_into_the_new(
    data: st.DataObject, old: list[Message], addressing: str
) -> None:
    new = data.draw(rewrite(old))
    spans = render(old).spans if addressing != "anchor" else ()
    plan = infer_directives(old, new, spans=spans, render=render, addressing=addressing)  # type: ignore[arg-type]
    assert plan.fallback is None
    check(old, new, plan)


@settings(max_examples=200, deadline=None)
@given(st.data(), st.lists(messages(), max_size=8))
def test_token_spans_keep_separators_between_messages_right(
    data: st.DataObject, old: list[Message]
) -> None:
    new = data.draw(rewrite(old))
    plan = infer_directives(
        old, new, spans=render_with_gaps(old).spans, render=render_with_gaps, addressing="token"
    )
    assert plan.fallback is None
    check(old, new, plan, render_with_gaps)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.lists(messages(), max_size=8), st.booleans())
def test_without_the_servers_rendering_it_is_exact_or_says_why_not(
    data: st.DataObject, old: list[Message], with_spans: bool
) -> None:
    new = data.draw(rewrite(old))
    plan = infer_directives(old, new, spans=render(old).spans if with_spans else ())
    if plan.fallback is not None:
        assert plan.directives == () and "render" in plan.fallback
    else:
        check(old, new, plan)


@st.composite
def policy_edits(draw: st.DrawFn, old: list[Message]) -> list[PolicyEdit]:
    edits: list[PolicyEdit] = []
    mode = st.sampled_from([Mode.amortize, Mode.amortize, Mode.forget])
    for index in range(len(old)):
        action = draw(st.sampled_from(["none", "none", "stub", "drop"]))
        if action == "stub":
            edits.append(ReplaceContent(index, draw(TEXT), draw(mode)))
        elif action == "drop":
            edits.append(DropMessages((index,), draw(mode)))
    notes = draw(st.lists(st.text(alphabet="xyz", min_size=1, max_size=4), max_size=2))
    return edits + [AppendErratum(n) for n in notes]


@settings(max_examples=300, deadline=None)
@given(st.data(), st.lists(messages(), max_size=8), st.sampled_from(["anchor", "token"]))
def test_policy_edits_become_directives_with_their_modes(
    data: st.DataObject, old: list[Message], addressing: str
) -> None:
    edits = data.draw(policy_edits(old))
    spans = render(old).spans
    plan = edits_to_directives(old, edits, spans=spans, addressing=addressing)  # type: ignore[arg-type]
    # Stubs, drops and notes need no renderer, unless a stub fills a message that had no
    # text content: then there is no content part to address and the message is replaced.
    unaddressable = [
        e
        for e in edits
        if isinstance(e, ReplaceContent)
        and not content_text(old[e.message])
        and e.text != content_text(old[e.message])
    ]
    if plan.fallback:
        assert unaddressable and "render" in plan.fallback
        return
    check(old, plan.messages, plan)
    forgotten = {i for e in edits if getattr(e, "mode", None) is Mode.forget for i in _touched(e)}
    for directive in plan.directives:
        batch = resolve_batch(
            [directive], length=len(render(old).tokens), tokenize=tokenize, spans=spans
        )
        edit = batch.edits[0]
        covered = {s.message for s in spans if s.start < edit.end and edit.start < s.end}
        assert isinstance(directive, ForgetDirective) == bool(covered & forgotten)


def _touched(edit: PolicyEdit) -> tuple[int, ...]:
    if isinstance(edit, ReplaceContent):
        return (edit.message,)
    return edit.messages if isinstance(edit, DropMessages) else ()
