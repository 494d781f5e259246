"""The SDK's fallback path against a real plain OpenAI-compatible server: the host's own route.

The client sees the live server as a plain one (an HTTP transport that answers 404 for
every ``/leyline`` path, as the host without Leyline would), so the wrapper sends edited
messages with no directives and the host's prefix cache does what it can. The host reports
the prompt tokens it found cached (SGLang with ``--enable-cache-report``, vLLM with
``--enable-prompt-tokens-details``, both set by the live scripts). One debugging trajectory
is replayed under three policies: none, ``clear_tool_uses`` (clears in one batch when its
trigger crosses, stubs byte-stable) and ``truncate:keep_last=2`` (a stub every turn). The
batch clearer must keep the host's prefix cache hitting far better than the per-turn
truncation, which moves the first changed token every turn.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import openai

from leyline.evals.mechanism.synthetic import synthetic_trajectory
from leyline.policies import LeylineOpenAI

from ._live import record

TURNS = 6


class PlainView(httpx.BaseTransport):
    """The live server minus the plugin's resources: ``/leyline/...`` answers 404."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/leyline/"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def _episode(policy: str | None) -> dict[str, Any]:
    base = openai.OpenAI(
        base_url=os.environ["LEYLINE_LIVE_URL"] + "/v1",
        api_key="none",
        http_client=httpx.Client(transport=PlainView(), timeout=600),
    )
    trajectory = synthetic_trajectory(7, seed=3, turns=TURNS)
    client = LeylineOpenAI(base, policy, detect_conversations=False)
    messages = trajectory.opening()
    prompt = cached = 0
    for turn in range(1, TURNS + 1):
        messages += trajectory.turn(turn)
        reply = client.chat.completions.create(
            model="default", messages=messages, tools=trajectory.tool_specs(), max_tokens=1,
            temperature=0,
        )  # fmt: skip
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        prompt += usage.prompt_tokens
        cached += usage.prompt_tokens_details.cached_tokens or 0
    assert not client.probe().leyline and all(r.directives == 0 for r in client.records)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt}


def test_batch_clearing_keeps_a_plain_prefix_cache_hitting(report_path: Path | None) -> None:
    runs = {
        "none": _episode(None),
        "clear_tool_uses": _episode("clear_tool_uses:trigger=1200,keep=2"),
        "truncate": _episode("truncate:keep_last=2"),
    }
    for name, figures in runs.items():
        record(report_path, check=f"plain prefix cache: {name}", **figures)
    hit = {name: figures["hit_rate"] for name, figures in runs.items()}
    assert hit["none"] > hit["clear_tool_uses"] > hit["truncate"], hit
    assert runs["clear_tool_uses"]["prompt_tokens"] < runs["none"]["prompt_tokens"]
