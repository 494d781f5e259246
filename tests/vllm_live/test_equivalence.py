"""vLLM's own forward on the KV the backend built vs the reference engine on the same weights.

Each check: a session on the live server, an edit through ``/leyline/v1``, then a completion
turn on the session (one greedy token, top-20 logprobs; after a splice its KV is in a
namespace only its requests read). The reference engine prefills the same tokens and applies
the edit as the backend built it (``reference_built``: the rows vLLM had no cached source for are
computed afresh); both run in fp32, so the logprobs must agree to ``TOLERANCE``. The control:
the same distribution against the reference's fresh prefill of the edited tokens must
disagree, so the bound tells kept (rotated) KV from a recomputation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from tests.sglang_live._live import (
    TOLERANCE,
    directive,
    edited_session,
    max_delta,
    prompt_text,
    record,
    reference_logprobs,
    session_generate,
    session_tokens,
)

from ._live import generate, reference_built

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

CUT = 40
STUB = " [tool output removed]"


def test_prefill_matches_reference(
    server: httpx.Client, reference: Engine, report_path: Path | None
) -> None:
    """The noise floor: no edit, vLLM's prefill vs the reference's."""
    tokens = list(reference.encode(prompt_text("prefill")))
    got = generate(server, tokens)
    delta = max_delta(got.top, reference_logprobs(reference, tokens))
    record(report_path, check="prefill (no edit)", max_delta_logprob=delta, tokens=len(tokens))
    assert delta <= TOLERANCE


@pytest.mark.parametrize(
    ("kind", "replacement"), [("cut", ""), ("replace", STUB)], ids=["cut", "replacement"]
)
def test_splice_matches_reference_splice(
    server: httpx.Client,
    reference: Engine,
    block_size: int,
    report_path: Path | None,
    kind: str,
    replacement: str,
) -> None:
    tokens = list(reference.encode(prompt_text(f"splice-{kind}")))
    start = len(tokens) // 3
    edit = Edit(start, start + CUT, tuple(reference.encode(replacement) if replacement else ()))
    session, base, body = edited_session(server, tokens, [directive(edit)])
    assert body["path"] == "splice" and body["fallback_reason"] is None, body
    assert body["rotated_tokens"] > 0, body
    new, revision = session_tokens(server, session)
    assert new == tokens[:start] + list(edit.replacement) + tokens[edit.end :]
    assert revision == base + 1
    got = session_generate(server, session, new)
    assert got.cached_tokens >= body["reused_tokens"], got.report
    delta = max_delta(got.top, reference_built(reference, tokens, edit, block_size))
    control = max_delta(got.top, reference_logprobs(reference, new))
    as_if_all_kept = max_delta(got.top, reference_logprobs(reference, tokens, [edit]))
    record(
        report_path,
        check=f"splice ({kind})",
        max_delta_logprob=delta,
        vs_fresh_prefill=control,
        vs_reference_splice_all_rows_kept=as_if_all_kept,
        tokens=len(tokens),
        span=[edit.start, edit.end],
        response=body,
        turn=got.report,
    )
    assert delta <= TOLERANCE
    assert control > 10 * TOLERANCE, "the splice reads as a prefill: the check cannot fail"


def test_forget_matches_fresh_prefill(
    server: httpx.Client, reference: Engine, report_path: Path | None
) -> None:
    tokens = list(reference.encode(prompt_text("forget")))
    start, end = len(tokens) // 3, len(tokens) // 3 + CUT
    forget = {"verb": "forget", "span": {"start": start, "end": end}}
    session, _, body = edited_session(server, tokens, [forget])
    assert body["path"] == "reprefill" and body["reused_tokens"] <= start, body
    new, _ = session_tokens(server, session)
    assert new == tokens[:start] + tokens[end:]
    got = generate(server, new)  # the forget re-prefilled the session: a plain hit
    assert got.cached_tokens >= start - start % 128 or got.cached_tokens > 0, got
    fresh = reference_logprobs(reference, new)
    forgot = reference_logprobs(reference, tokens, [Edit(start, end, (), Mode.forget)])
    delta = max_delta(got.top, fresh)
    record(
        report_path, check="forget vs fresh prefill", max_delta_logprob=delta,
        cached_tokens=got.cached_tokens, response=body,
    )  # fmt: skip
    assert delta <= TOLERANCE
    assert max_delta(got.top, forgot) <= TOLERANCE  # the reference's forget is a re-prefill
