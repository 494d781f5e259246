"""Chat on the live server: an unchanged OpenAI client gets the host's own route; a chat
carrying a ``leyline`` object gets the backend's (sessions, message-anchored directives,
reports), and its next-token logprobs equal the reference engine's."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

from leyline.protocol.resources import Routes

from ..serve.conversation import TOOLS, turn1
from ._live import TOLERANCE, plain_hit, prompt_text, record

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

STUB = "[evicted: read_file output]"


def _chat(server: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "max_tokens": 6, "temperature": 0}
    reply = server.post("/v1/chat/completions", json=body | extra)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_an_unchanged_openai_client_chats() -> None:
    """The OpenAI SDK as any user has it, plain and streamed: the host answers (no leyline
    report), with the plugin loaded."""
    import openai

    client = openai.OpenAI(base_url=os.environ["LEYLINE_LIVE_URL"] + "/v1", api_key="none")
    messages: Any = [{"role": "user", "content": "Name a colour in one word."}]
    plain = client.chat.completions.create(
        model="default", messages=messages, max_tokens=6, temperature=0
    )
    assert isinstance(plain.choices[0].message.content, str)  # a random model may say ""
    assert plain.usage is not None and plain.usage.prompt_tokens > 0
    assert plain.usage.completion_tokens >= 1
    assert "leyline" not in (plain.model_extra or {})  # the host's route, not the plugin's
    chunks = client.chat.completions.create(
        model="default", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content


def test_chat_with_an_anchored_splice_matches_the_reference(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None
) -> None:
    """Turn 1 creates the session; turn 2 comes back as an extension (a prefix hit); turn 3
    splices the tool output by message anchor in the same request and asks with logprobs:
    the backend reports a splice, and the distribution equals the reference engine's splice
    of the same span, as the backend builds it (``_built``)."""
    from leyline.protocol.algebra import Edit

    from ._built import built_session

    sid = f"chat-{uuid.uuid4().hex[:8]}"
    messages = turn1()
    first = _chat(server, messages, tools=TOOLS, leyline={"session": sid})
    assert first["leyline"]["session"] == sid
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        # A long second question: the splice then keeps whole blocks of it downstream.
        {"role": "user", "content": prompt_text("chat", lines=12) + " Answer in one word."},
    ]
    second = _chat(server, messages, tools=TOOLS, leyline={"session": sid})
    assert second["leyline"]["path"] == "prefix_hit", second["leyline"]
    assert second["leyline"]["reused_tokens"] >= plain_hit(first["usage"]["prompt_tokens"], page)

    before = server.get(Routes.session.format(session=sid), params={"tokens": "true"}).json()
    directive = {"verb": "splice", "span": {"message": 3, "part": "content"}, "replacement": STUB}
    messages[3] = {**messages[3], "content": STUB}
    messages += [
        {"role": "assistant", "content": second["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the day?"},
    ]
    leyline = {"session": sid, "base_revision": before["revision"], "directives": [directive]}
    third = _chat(
        server, messages, tools=TOOLS, leyline=leyline, logprobs=True, top_logprobs=20,
        max_tokens=1,
    )  # fmt: skip
    ley = third["leyline"]
    assert ley["path"] == "splice" and ley["fallback_reason"] is None, ley | {"spans": None}
    span = before["spans"][3]["content"]
    downstream = before["num_tokens"] - span["end"]
    # All of it but the last generated token, whose KV the server never computed.
    assert downstream - 1 <= ley["rotated_tokens"] <= downstream, ley
    after = server.get(Routes.session.format(session=sid), params={"tokens": "true"}).json()
    assert after["revision"] == ley["revision"] > before["revision"]

    stub = list(reference.encode(STUB))
    edit = Edit(span["start"], span["end"], tuple(stub))
    # The prompt the server ran: the render of the messages, except that a reply sent back
    # as it was generated keeps its generated ids (they may not be what rendering gives).
    prompt = after["tokens"][: third["usage"]["prompt_tokens"]]
    rendered = server.post(
        Routes.tokenize, json={"messages": messages, "tools": TOOLS, "add_generation_prompt": True}
    ).json()["tokens"]
    detok = server.post(Routes.detokenize, json={"tokens": prompt}).json()["text"]
    assert detok == server.post(Routes.detokenize, json={"tokens": rendered}).json()["text"]
    assert prompt[span["start"] : span["start"] + len(stub)] == stub  # the edit, as tokens
    session = built_session(reference, before["tokens"], [edit])
    session.prefill(prompt)
    expected = torch.log_softmax(session.next_token_logits().double(), -1)
    top = third["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    delta = max(abs(e["logprob"] - float(expected[e["token_id"]])) for e in top)
    record(report_path, check="chat: anchored splice", max_delta_logprob=delta, tokens=len(prompt))
    assert len(top) == 20 and delta <= TOLERANCE


def test_chat_with_an_anchored_forget_and_a_stale_revision(server: httpx.Client) -> None:
    """FORGET by message anchor in a chat: re-prefilled from the edit point; the same
    request again names a stale revision and is refused with 409, nothing changed."""
    sid = f"chat-forget-{uuid.uuid4().hex[:8]}"
    messages = turn1()
    _chat(server, messages, tools=TOOLS, leyline={"session": sid})
    before = server.get(Routes.session.format(session=sid), params={"tokens": "true"}).json()
    directive = {"verb": "forget", "span": {"message": 3}}
    edited = messages[:3] + messages[4:]
    leyline = {"session": sid, "base_revision": before["revision"], "directives": [directive]}
    reply = _chat(server, edited, tools=TOOLS, leyline=leyline)
    ley = reply["leyline"]
    assert ley["path"] == "reprefill" and ley["rotated_tokens"] == 0, ley
    assert ley["reused_tokens"] <= before["spans"][3]["start"]
    stale = server.post(
        "/v1/chat/completions",
        json={"model": "default", "messages": edited, "max_tokens": 2, "tools": TOOLS,
              "leyline": leyline},
    )  # fmt: skip
    assert stale.status_code == 409, stale.text
    assert stale.json()["error"]["code"] == "revision_conflict"
    after = server.get(Routes.session.format(session=sid)).json()
    assert after["revision"] == ley["revision"]
