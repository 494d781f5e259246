"""Chat logprobs name each token by id and carry its own bytes (issue 11, item 10)."""

from __future__ import annotations

import pytest

from leyline.engine.models import load_model

from .conftest import Server

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_logprob_entries_carry_ids_and_their_own_bytes(server: Server) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Say: héllo wörld 🎉"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    with server.client() as http:
        reply = http.post("/v1/chat/completions", json=body).json()
    entries = reply["choices"][0]["logprobs"]["content"]
    tokenizer = load_model("smollm2").tokenizer
    assert tokenizer is not None and entries
    for entry in entries:
        assert entry["token"] == tokenizer.decode([entry["token_id"]])
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]  # greedy
        for top in entry["top_logprobs"]:
            assert top["token"] == tokenizer.decode([top["token_id"]])
    # Bytes of consecutive tokens add up to the text, even across a multi-byte character
    # split between tokens (each token alone decodes to U+FFFD there).
    ids = [e["token_id"] for e in entries]
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert joined.decode("utf-8", errors="replace") == text
    assert any(len(e["bytes"]) != len(e["token"].encode()) for e in entries)  # split chars
