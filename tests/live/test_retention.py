"""PIN and SCRATCH on the live SGLang server: the session core's rules hold there too.

A pin refuses an edit over it (409, nothing changed) and moves with an edit upstream; a
scratch mark on a chat turn is dropped when that turn's generation completes, and the next
token's distribution of the session afterwards equals the reference engine's full prefill
of the tokens the session then holds (a FORGET: nothing of the span remains).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from leyline.protocol.resources import Routes

from ..serve.conversation import TOOLS, turn1
from ._live import TOLERANCE, generate, max_delta, record, reference_logprobs

if TYPE_CHECKING:
    from leyline.engine.engine import Engine


def _session(server: httpx.Client, sid: str) -> dict[str, Any]:
    got = server.get(Routes.session.format(session=sid), params={"tokens": "true"})
    assert got.status_code == 200, got.text
    return dict(got.json())


def _apply(server: httpx.Client, sid: str, revision: int, *directives: Any) -> httpx.Response:
    body = {"base_revision": revision, "directives": list(directives)}
    return server.post(Routes.directives.format(session=sid), json=body)


def test_a_pin_refuses_an_edit_over_it_and_moves_with_one_upstream(server: httpx.Client) -> None:
    sid = f"pin-{uuid.uuid4().hex[:8]}"
    body = {"model": "default", "messages": turn1(), "max_tokens": 2, "tools": TOOLS}
    assert server.post("/v1/chat/completions", json=body | {"leyline": {"session": sid}}).is_success
    held = _session(server, sid)
    tool = held["spans"][3]["content"]
    pin = {"verb": "pin", "span": {"message": 3, "part": "content"}}
    assert _apply(server, sid, held["revision"], pin).status_code == 200
    pinned = _session(server, sid)
    assert pinned["revision"] == held["revision"]
    assert [(m["verb"], m["start"], m["end"]) for m in pinned["marks"]] == [
        ("pin", tool["start"], tool["end"])
    ]
    splice = {"verb": "splice", "span": {"start": tool["start"] + 1, "end": tool["start"] + 3},
              "replacement": "x"}  # fmt: skip
    refused = _apply(server, sid, pinned["revision"], splice)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "pinned_span"
    assert _session(server, sid) == pinned
    upstream = {"verb": "splice", "span": {"message": 1, "part": "content"}, "replacement": "Hi."}
    assert _apply(server, sid, pinned["revision"], upstream).status_code == 200
    moved = _session(server, sid)
    (mark,) = moved["marks"]
    assert (
        moved["tokens"][mark["start"] : mark["end"]] == held["tokens"][tool["start"] : tool["end"]]
    )


def test_a_scratch_span_is_dropped_after_its_turn_and_leaves_nothing(
    server: httpx.Client, reference: Engine, report_path: Path | None
) -> None:
    sid = f"scratch-{uuid.uuid4().hex[:8]}"
    messages = turn1()
    body = {"model": "default", "messages": messages, "max_tokens": 2, "tools": TOOLS}
    first = server.post("/v1/chat/completions", json=body | {"leyline": {"session": sid}})
    assert first.status_code == 200, first.text
    held = _session(server, sid)
    tool = held["spans"][3]["content"]
    messages = [*messages, {"role": "assistant", "content": first.json()["choices"][0]["message"]
                            ["content"]}, {"role": "user", "content": "Thanks."}]  # fmt: skip
    scratch = {"verb": "scratch", "span": {"message": 3, "part": "content"}}
    leyline = {"session": sid, "base_revision": held["revision"], "directives": [scratch]}
    reply = server.post(
        "/v1/chat/completions", json=body | {"messages": messages, "leyline": leyline}
    )
    assert reply.status_code == 200, reply.text
    ley = reply.json()["leyline"]
    assert [(d["verb"], d["start"], d["end"]) for d in ley["dropped"]] == [
        ("scratch", tool["start"], tool["end"])
    ]
    after = _session(server, sid)
    assert after["revision"] == ley["revision"] and after["marks"] == []
    assert after["tokens"][: tool["start"]] == held["tokens"][: tool["start"]]

    # What the session holds now behaves as a prefill of its tokens from scratch: SGLang's
    # own generate finds the session's KV in its tree by prefix, and its distribution
    # equals the reference engine's full prefill of the same tokens.
    got = generate(server, after["tokens"])
    delta = max_delta(got.top, reference_logprobs(reference, after["tokens"]))
    record(report_path, check="scratch dropped vs full prefill", max_delta_logprob=delta,
           cached_tokens=got.cached_tokens)  # fmt: skip
    assert delta <= TOLERANCE
