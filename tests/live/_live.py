"""What the live tests share: sessions and generates over HTTP, the reference engine's view
of the same tokens and edits, and the one measure they are compared by."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import torch

from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.resources import Routes

from ._built import built_session
from ._plain import (
    BACKEND,
    TOP,
    Generated,
    floor_page,
    generate,
    generate_ids,
    page_size,
    plain_hit,
)

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

TOLERANCE = 1e-3
"""max |Δ logprob| between the live server and the reference engine, both fp32."""

_LINES = [
    "The build of service {i} failed at step {j}: the linker could not find libfoo.so.",
    "Tool output {i}: 14 files changed, {j} insertions, 3 deletions in src/core.",
    "Note {i}: the cache keeps {j} entries and evicts the oldest one first.",
    "Step {i}: the test suite ran {j} tests in 2.5 seconds and two of them failed.",
]


def prompt_text(tag: str, lines: int = 16) -> str:
    """A tool-log-like prompt of a few hundred tokens. ``tag`` (plus a per-run nonce) makes
    its first line unique, so no two checks share a radix-tree path: a splice is never
    answered from KV that another check prefilled."""
    head = f"Run {uuid.uuid4().hex[:8]}, check {tag}. The agent reads its log:\n"
    body = "\n".join(_LINES[i % len(_LINES)].format(i=i, j=7 * i + 3) for i in range(lines))
    return head + body + "\nQuestion: which step failed first? Answer:"


def create_session(server: httpx.Client, tokens: Sequence[int]) -> tuple[str, int]:
    """A new session holding ``tokens``: its id and revision (what the next batch names)."""
    reply = server.post(Routes.sessions, json={"tokens": list(tokens)})
    assert reply.status_code == 201, reply.text
    body = reply.json()
    return str(body["session"]), int(body["revision"])


def edited_session(
    server: httpx.Client, tokens: Sequence[int], directives: list[dict[str, Any]]
) -> tuple[str, int, dict[str, Any]]:
    """A new session holding ``tokens``, then ``directives`` applied to it (they must be
    accepted): its id, the revision they addressed, and the reply's body."""
    session, base = create_session(server, tokens)
    reply = apply(server, session, base, directives)
    assert reply.status_code == 200, reply.text
    return session, base, dict(reply.json())


def directive(edit: Edit) -> dict[str, Any]:
    """``edit`` as the wire's splice or forget directive."""
    verb = "forget" if edit.mode is Mode.forget else "splice"
    span = {"start": edit.start, "end": edit.end}
    return {"verb": verb, "span": span, "replacement": list(edit.replacement)}


def session_tokens(server: httpx.Client, session: str) -> tuple[list[int], int]:
    reply = server.get(Routes.session.format(session=session), params={"tokens": "true"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return list(body["tokens"]), int(body["revision"])


def apply(
    server: httpx.Client, session: str, revision: int, directives: list[dict[str, Any]]
) -> httpx.Response:
    return server.post(
        Routes.directives.format(session=session),
        json={"base_revision": revision, "directives": directives},
    )


def session_generate(server: httpx.Client, session: str, tokens: Sequence[int]) -> Generated:
    """A completion turn on ``session`` with ``tokens`` as its prompt (one greedy token,
    top-20 logprobs): the session's own distribution. After a splice or a compose the
    session's KV is in a namespace only its own requests read, so a plain ``/generate`` of
    the same tokens gets a fresh prefill instead. ``cached_tokens`` is the turn's
    ``reused_tokens``.

    The completions API keys its top logprobs by text, so each text is tokenized back to an
    id. Texts holding U+FFFD are skipped: in SmolLM2's vocabulary 314 byte tokens print as
    it and its text tokenizes to one other id (24211), so such an entry would pair one
    token's logprob with another's (a random-weight model puts byte tokens in its top 20:
    a spurious 8.3 nats in one CI run)."""
    body = {
        "prompt": list(tokens), "max_tokens": 1, "temperature": 0, "logprobs": TOP,
        "leyline": {"session": session},
    }  # fmt: skip
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    top: dict[int, float] = {}
    for text, logprob in out["choices"][0]["logprobs"]["top_logprobs"][0].items():
        if "\ufffd" in text:
            continue  # a byte token's text: ambiguous (docstring)
        ids = server.post(Routes.tokenize, json={"text": text}).json()["tokens"]
        if len(ids) == 1:  # texts that name one token unambiguously
            top[int(ids[0])] = float(logprob)
    assert len(top) >= 10, out["choices"][0]["logprobs"]
    report = out["leyline"]
    return Generated(top, int(report["reused_tokens"]), len(tokens), report)


def reference_logprobs(
    engine: Engine, tokens: Sequence[int], edits: Sequence[Edit] = ()
) -> torch.Tensor:
    """The reference engine's next-token logprobs after prefilling ``tokens`` and applying
    ``edits`` (a splice rotates the downstream KV; a forget re-prefills), float64."""
    from leyline.engine.session import SessionCache

    session = SessionCache(engine)  # standalone: no prefix cache, nothing shared
    session.prefill(tokens)
    if edits:
        session.apply_edits(edits)
    return torch.log_softmax(session.next_token_logits().double(), -1)


def reference_compose_logprobs(
    engine: Engine, tokens: Sequence[int], skill: Sequence[int], at: int, seam: int
) -> torch.Tensor:
    """The reference engine's next-token logprobs after prefilling ``tokens`` and composing
    ``skill`` (compiled on its own) at ``at`` with a ``seam``-token seam, float64."""
    from leyline.engine.edits.skills import compile_skill
    from leyline.engine.session import SessionCache

    session = SessionCache(engine)
    session.prefill(tokens)
    session.compose(compile_skill(engine, skill, skill_id="x", tenant="t"), at, seam_tokens=seam)
    return torch.log_softmax(session.next_token_logits().double(), -1)


def built_logprobs(
    engine: Engine, tokens: Sequence[int], edits: Sequence[Edit], fallback: str | None = None
) -> torch.Tensor:
    """The reference engine's next-token logprobs for what the live backend built when
    ``edits`` applied to ``tokens`` and it reported ``fallback`` (``_built``: the definition
    when it reports none), float64."""
    session = built_session(engine, tokens, edits, fallback)
    return torch.log_softmax(session.next_token_logits().double(), -1)


def max_delta(top: dict[int, float], reference: torch.Tensor) -> float:
    """max |Δ logprob| over the server's top-20 tokens against the reference's full vector."""
    return max(abs(lp - float(reference[tok])) for tok, lp in top.items())


def record(path: Path | None, **figures: Any) -> None:
    """Append one measured line to the run's report (printed by the live checks)."""
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(figures) + "\n")


@contextmanager
def switched_on(variable: str, how: str) -> Iterator[None]:
    """A negative control's switch in the live shims (tests/live/_stubs/shims): on while
    the file that the environment variable ``variable`` names exists, here and in the
    server alike. Fails, saying ``how`` to set it, when the variable is not set."""
    flag = os.environ.get(variable)
    if not flag:
        pytest.fail(f"{variable} is not set: {how}")
    Path(flag).touch()
    try:
        yield
    finally:
        Path(flag).unlink()


__all__ = [
    "BACKEND", "TOLERANCE", "TOP", "Generated", "apply", "built_logprobs", "create_session",
    "directive", "edited_session", "floor_page", "generate", "generate_ids", "max_delta",
    "page_size", "plain_hit", "prompt_text", "record", "reference_compose_logprobs",
    "reference_logprobs", "session_generate", "session_tokens", "switched_on",
]  # fmt: skip
