"""A multi-turn session over HTTP: prefix reuse, then a splice that matches the engine's."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from leyline.engine.engine import Engine
from leyline.engine.models import load_model
from leyline.engine.session import SessionCache

from .conftest import Server
from .conversation import TOOLS, turn1

pytestmark = [pytest.mark.slow, pytest.mark.model]

STUB = "[evicted: read_file output]"


def chat(server: Server, messages: list[dict[str, Any]], **leyline: Any) -> dict[str, Any]:
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "tools": TOOLS,
        "leyline": leyline,
    }
    with server.client() as http:
        reply = http.post("/v1/chat/completions", json=body | leyline.pop("_extra", {}))
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_turns_reuse_the_prefix_and_a_splice_matches_the_engine(server: Server) -> None:
    messages = turn1()
    first = chat(server, messages, session="multi")
    ley1 = first["leyline"]
    assert ley1["path"] == "reprefill" and ley1["reused_tokens"] == 0  # a cold session
    spans = {s["message"]: s for s in ley1["spans"]}
    assert set(spans) == set(range(len(messages)))

    # Turn 2: the client sends back the model's reply and asks again: a prefix hit.
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Answer in one word."},
    ]
    second = chat(server, messages, session="multi")
    ley2 = second["leyline"]
    assert ley2["path"] == "prefix_hit"
    assert ley2["reused_tokens"] >= first["usage"]["prompt_tokens"]
    # OpenAI's own field says the same: the prompt tokens found cached.
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == ley2["reused_tokens"] and first["usage"]["prompt_tokens_details"] == {
        "cached_tokens": first["leyline"]["reused_tokens"]
    }

    # Turn 3: splice the tool output (message 3) to a stub, addressed by message anchor.
    with server.client() as http:
        before = http.get("/leyline/v1/sessions/multi", params={"tokens": "true"}).json()
    directive = {"verb": "splice", "span": {"message": 3, "part": "content"}, "replacement": STUB}
    messages[3] = {**messages[3], "content": STUB}
    messages += [
        {"role": "assistant", "content": second["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the day?"},
    ]
    body_extra = {"_extra": {"logprobs": True, "top_logprobs": 5, "max_tokens": 1}}
    third = chat(
        server,
        messages,
        session="multi",
        base_revision=before["revision"],
        directives=[directive],
        **body_extra,
    )
    ley3 = third["leyline"]
    assert ley3["path"] == "splice" and ley3["fallback_reason"] is None, {
        k: v for k, v in ley3.items() if k != "spans"
    }
    content = before["spans"][3]["content"]
    downstream = before["num_tokens"] - content["end"]
    assert ley3["rotated_tokens"] == downstream
    assert ley3["reused_tokens"] + ley3["prefilled_tokens"] == third["usage"]["prompt_tokens"]
    assert ley3["prefilled_tokens"] < downstream  # the point: downstream was not recomputed

    # The same splice in-process on the engine gives the same next-token distribution.
    engine = Engine(load_model("smollm2"))
    session = SessionCache(engine)
    session.prefill(before["tokens"], spans=_spans(before["spans"]))
    session.apply_directives([_directive(directive)], base_revision=session.revision)
    with server.client() as http:
        prompt = http.post(
            "/leyline/v1/tokenize",
            json={"messages": messages, "tools": TOOLS, "add_generation_prompt": True},
        ).json()["tokens"]
    assert len(prompt) == third["usage"]["prompt_tokens"]
    session.prefill(prompt)
    expected = torch.log_softmax(session.next_token_logits(), dim=-1)
    top = third["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    for entry in top:
        token = engine.encode(entry["token"])
        if len(token) == 1:
            assert math.isclose(entry["logprob"], float(expected[token[0]]), abs_tol=2e-3)


def test_a_splice_the_messages_do_not_carry_is_reported_as_what_ran(server: Server) -> None:
    """The client asks for a splice but sends the unedited messages: the prompt is prefilled
    over the splice, and the report says so (no rotation claimed, token_mismatch)."""
    messages = turn1()
    chat(server, messages, session="mismatch")
    with server.client() as http:
        before = http.get("/leyline/v1/sessions/mismatch", params={"tokens": "true"}).json()
    directive = {"verb": "splice", "span": {"message": 3, "part": "content"}, "replacement": STUB}
    reply = chat(
        server,
        messages,  # message 3 still holds the full tool output
        session="mismatch",
        base_revision=before["revision"],
        directives=[directive],
    )
    ley = reply["leyline"]
    assert (ley["path"], ley["fallback_reason"], ley["rotated_tokens"]) == (
        "reprefill",
        "token_mismatch",
        0,
    )
    assert ley["reused_tokens"] + ley["prefilled_tokens"] == reply["usage"]["prompt_tokens"]
    with server.client() as http:
        after = http.get("/leyline/v1/sessions/mismatch", params={"tokens": "true"}).json()
    n = reply["usage"]["prompt_tokens"]
    assert after["tokens"][:n] == before["tokens"][:n]  # it holds what the client sent


def test_a_completion_on_a_session_keeps_the_message_spans(server: Server) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    with server.client() as http:
        made = http.post(
            "/leyline/v1/sessions", json={"session": "keep-spans", "messages": messages}
        )
        assert made.status_code == 201, made.text
        info = http.get("/leyline/v1/sessions/keep-spans", params={"tokens": "true"}).json()
        body = {
            "prompt": info["tokens"] + [28],
            "max_tokens": 2,
            "temperature": 0,
            "leyline": {"session": "keep-spans", "base_revision": info["revision"]},
        }
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        after = http.get("/leyline/v1/sessions/keep-spans").json()
    assert after["spans"] == info["spans"] and len(after["spans"]) == 2
    anchor = {"verb": "forget", "span": {"message": 1, "part": "content"}}
    with server.client() as http:
        applied = http.post(
            "/leyline/v1/sessions/keep-spans/directives",
            json={"base_revision": after["revision"], "directives": [anchor]},
        )
    assert applied.status_code == 200, applied.text  # anchors still resolve


def test_a_reply_sent_back_unchanged_keeps_its_generated_ids(server: Server) -> None:
    """The model may generate a text as ids its tokenizer would not choose; sent back as an
    assistant message, the reply must still hit the cache (issue 11, item 11)."""
    tokenizer = load_model("smollm2").tokenizer
    assert tokenizer is not None
    opening = [{"role": "user", "content": "Capital of France? One word."}]
    with server.client() as http:
        prompt = http.post(
            "/leyline/v1/tokenize",
            json={"messages": opening, "tools": TOOLS, "add_generation_prompt": True},
        ).json()["tokens"]
        # "Paris" as the model might have spelled it: "P" + "aris", not the canonical id.
        reply = tokenizer.encode("P", add_special_tokens=False) + tokenizer.encode(
            "aris", add_special_tokens=False
        )
        assert reply != tokenizer.encode("Paris", add_special_tokens=False)
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        cached = prompt + reply + [end]
        made = http.post("/leyline/v1/sessions", json={"session": "drift", "tokens": cached})
        assert made.status_code == 201, made.text
    messages = [
        *opening,
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Germany?"},
    ]
    ley = chat(server, messages, session="drift", base_revision=made.json()["revision"])
    leyline = ley["leyline"]
    assert leyline["path"] == "prefix_hit" and leyline["fallback_reason"] is None
    assert leyline["reused_tokens"] >= len(cached)
    with server.client() as http:
        after = http.get("/leyline/v1/sessions/drift", params={"tokens": "true"}).json()
    assert after["tokens"][: len(cached)] == cached  # the generated ids were kept
    content = after["spans"][1]["content"]
    assert after["tokens"][content["start"] : content["end"]] == reply


def _spans(raw: list[dict[str, Any]]) -> list[Any]:
    from leyline.protocol import MessageSpan

    return [MessageSpan.model_validate(s) for s in raw]


def _directive(raw: dict[str, Any]) -> Any:
    from leyline.protocol import parse_directives

    return parse_directives([raw])[0]
