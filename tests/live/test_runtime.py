"""A splice is answered as the server's runtime allows: spliced with the radix cache, a typed
``unsupported_runtime`` fallback without it (``--disable-radix-cache``; ``make
sglang-live-check`` with ``LEYLINE_SGLANG_LIVE_EXTRA=1`` starts such a server and runs only
this file against it). Either way the session moves on and SGLang keeps serving."""

from __future__ import annotations

import random

import httpx
import pytest

from leyline.protocol.envelope import LeylineResponse

from ._live import apply, edited_session, generate_ids, session_tokens

# SGLang's radix-cache switch (/server_info).
pytestmark = pytest.mark.backends("sglang")


def test_splice_and_forget_are_answered_as_the_runtime_allows(server: httpx.Client) -> None:
    info = server.get("/server_info")
    assert info.status_code == 200, info.text
    tree = not info.json()["disable_radix_cache"]
    tokens = [random.randrange(1000, 20000) for _ in range(100)]  # a path of its own
    cut = {"verb": "splice", "span": {"start": 10, "end": 20}}
    session, _, reply_body = edited_session(server, tokens, [cut])
    body = LeylineResponse.model_validate(reply_body)
    if tree:
        assert body.path.value == "splice", body
    else:
        assert body.path.value == "reprefill", body
        assert body.fallback_reason is not None
        assert body.fallback_reason.value == "unsupported_runtime", body
    new, revision = session_tokens(server, session)
    assert new == tokens[:10] + tokens[20:]
    forget = {"verb": "forget", "span": {"start": 30, "end": 40}}
    reply = apply(server, session, revision, [forget])
    assert reply.status_code == 200, reply.text
    assert LeylineResponse.model_validate(reply.json()).path.value == "reprefill"
    new = session_tokens(server, session)[0]
    out, cached = generate_ids(server, new, 2)  # SGLang keeps serving the edited session
    assert len(out) == 2 and (tree or cached == 0)
