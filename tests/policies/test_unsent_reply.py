"""The cached reply the agent did not send back, against a SCRIPTED Leyline server.

``compose_server`` applies each batch with ``apply_edits`` on the TOY rendering of
``toy_chat`` and records a mismatch whenever the request's prompt does not extend the
edited cache; no model. An agent that sends its own assistant message instead of the
generated one leaves the generated reply cached after the served messages: a batch with
edits must take it out, and replacing it with the agent's message keeps the tokens the two
share (spec section 4, rule 5) where a plain deletion would prefill them again.
"""

from __future__ import annotations

from typing import Any

from leyline.policies import LeylineOpenAI
from leyline.protocol import SpliceDirective, TokenSpan, Verb, apply_edits, resolve_batch

from .compose_server import GENERATION_PROMPT, ComposeServer
from .toy_chat import render, tokenize
from .transcripts import assistant, system, user


def ask(client: LeylineOpenAI, history: list[Any]) -> str:
    completion = client.chat.completions.create(model="toy", messages=history)
    return str(completion.choices[0].message.content)


def reused_by(tokens: list[int], spans: list[Any], directives: list[Any]) -> int:
    """Tokens whose KV the batch keeps, by the protocol's own algebra."""
    batch = resolve_batch(
        directives, length=len(tokens), tokenize=tokenize, spans=spans, supported=list(Verb)
    )
    return apply_edits(tokens, batch.edits).reused_tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_agents_own_message_replaces_the_unsent_reply_keeping_what_they_share() -> None:
    server = ComposeServer()
    client = LeylineOpenAI(server.openai())
    history: list[Any] = [system(), user("Fix the failing test."), user("Notes: none.")]
    generated = ask(client, history)  # not sent back: the agent writes its own message
    session = server.sessions[client.session]
    cached, spans = list(session.tokens), list(session.spans)
    served_end = render(history).spans[-1].end
    history[2] = user("Notes: sum_tree.py.")  # an edit: the batch is not empty
    history += [assistant(text=f"{generated}, then a tool call"), user("Go on.")]
    ask(client, history)

    plan = client.episode.last_plan
    assert plan is not None and plan.tail_replaced
    new = render(history)
    mine = list(new.tokens[new.spans[2].end : new.spans[3].end])
    edit, tail = plan.directives  # the task's edit, then the tail: no separate deletion
    assert tail == SpliceDirective(
        span=TokenSpan(start=served_end, end=len(cached)), replacement=mine
    )
    assert server.mismatches == []  # the prompt extends the edited cache

    shared = common_prefix(cached[served_end:], mine)
    assert shared == len(GENERATION_PROMPT) + len(generated)  # header and the reply's text
    deletion = SpliceDirective(span=tail.span)
    kept = reused_by(cached, spans, [edit, tail])
    assert kept - reused_by(cached, spans, [edit, deletion]) == shared
    record = client.records[-1]
    assert (record.path, record.reused_tokens) == ("splice", kept)


def test_without_edits_the_request_extends_the_session_and_the_server_keeps_the_prefix() -> None:
    server = ComposeServer()
    client = LeylineOpenAI(server.openai())
    history: list[Any] = [system(), user("Fix the failing test.")]
    generated = ask(client, history)
    cached = list(server.sessions[client.session].tokens)
    history += [assistant(text=f"{generated}, then a tool call"), user("Go on.")]
    ask(client, history)
    plan = client.episode.last_plan
    assert plan is not None and plan.directives == () and not plan.tail_replaced
    new = render(history)
    served_end = new.spans[1].end
    shared = common_prefix(cached[served_end:], list(new.tokens[served_end:]))
    assert client.records[-1].reused_tokens == served_end + shared


def test_a_reply_sent_back_is_left_in_place() -> None:
    server = ComposeServer()
    client = LeylineOpenAI(server.openai())
    history: list[Any] = [system(), user("Fix the failing test."), user("Notes: none.")]
    history.append(assistant(text=ask(client, history)))
    history[2] = user("Notes: sum_tree.py.")
    history.append(user("Go on."))
    ask(client, history)
    plan = client.episode.last_plan
    assert plan is not None and not plan.tail_replaced
    assert len(plan.directives) == 1  # the task's edit; the cached reply is the sent one
    assert server.mismatches == []
