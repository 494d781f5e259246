"""The /leyline/v1 resources through the protocol's own typed client, plus ops endpoints."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from leyline.protocol import (
    ErrorCode,
    ForgetDirective,
    LeylineError,
    Path,
    SpliceDirective,
    TokenSpan,
    Verb,
)
from leyline.protocol.client import AsyncLeylineClient, LeylineClient
from leyline.protocol.schema import build_schema

from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_typed_client_drives_a_session_through_splice_and_forget(server: Server) -> None:
    with LeylineClient(server.base_url, api_key=API_KEY) as client:
        caps = client.capabilities()
        assert set(caps.verbs) == set(Verb)  # every verb, the retention ones included
        assert caps.architectures == ["gqa"]
        text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
        info = client.create_session("typed", text=text)
        tokens = client.tokenize(text).tokens
        assert info.num_tokens == len(tokens)
        assert client.detokenize(tokens) == text

        spliced = client.apply(
            "typed",
            info.revision,
            [SpliceDirective(span=TokenSpan(start=2, end=7), replacement=[30, 31])],
        )
        assert spliced.path is Path.splice and spliced.rotated_tokens == len(tokens) - 7
        forgot = client.apply(
            "typed", spliced.revision, [ForgetDirective(span=TokenSpan(start=1, end=2))]
        )
        assert forgot.path is Path.reprefill and forgot.rotated_tokens == 0
        assert forgot.revision == spliced.revision + 1
        with pytest.raises(LeylineError) as stale:
            client.apply("typed", info.revision, [ForgetDirective(span=TokenSpan(start=1, end=2))])
        assert stale.value.code is ErrorCode.revision_conflict
        assert client.schema() == build_schema()
        client.delete_session("typed")
        with pytest.raises(LeylineError) as gone:
            client.get_session("typed")
        assert gone.value.code is ErrorCode.unknown_session


def test_async_client_reads_capabilities(server: Server) -> None:
    async def go() -> list[Verb]:
        async with AsyncLeylineClient(server.base_url, api_key=API_KEY) as client:
            return (await client.capabilities()).verbs

    assert Verb.splice in asyncio.run(go())


def test_metrics_health_and_docs(server: Server) -> None:
    with server.client() as http:
        http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        metrics = http.get("/metrics").text
        assert "leyline_requests_total" in metrics and "leyline_tokens_total" in metrics
        assert 'leyline_paths_total{path="reprefill"}' in metrics
        assert "leyline_request_seconds_bucket" in metrics
        assert http.get("/docs").status_code == 200
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
