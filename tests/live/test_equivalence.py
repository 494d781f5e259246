"""The server's own forward on the KV the backend built vs the reference engine on the same
weights.

Each check: a session on the live server, an edit through ``/leyline/v1``, then the server's
generate of the session's tokens (one greedy token, top-20 logprobs): a completion turn on
the session once it spliced (its KV is then in a namespace of its own), else a plain
request. The reference engine prefills the same tokens and applies the same edit as the
backend builds it (``_built``); both run in fp32, so the next-token logprobs must agree to
``TOLERANCE``. Two negative controls: the same distribution against a fresh prefill of the
edited tokens must disagree (kept KV is told from a recomputation), and with the backend's
rotation switched off (tests/live/_stubs/shims) the splice must disagree with the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import torch

from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode

from ._live import (
    TOLERANCE,
    Generated,
    apply,
    built_logprobs,
    create_session,
    directive,
    edited_session,
    floor_page,
    generate,
    max_delta,
    plain_hit,
    prompt_text,
    record,
    reference_logprobs,
    session_generate,
    session_tokens,
    switched_on,
)

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

CUT = 40  # tokens removed from the middle of the prompt
STUB = " [tool output removed]"
ROTATION_OFF_FLAG = "LEYLINE_LIVE_ROTATION_OFF_FLAG"


@dataclass(frozen=True, slots=True)
class Spliced:
    tokens: list[int]
    """The session's tokens before the splice."""
    edit: Edit
    got: Generated
    """The session's turn after the splice."""
    response: dict[str, Any]

    @property
    def new(self) -> list[int]:
        """The session's tokens after the splice."""
        e = self.edit
        return self.tokens[: e.start] + list(e.replacement) + self.tokens[e.end :]

    def facts(self) -> dict[str, Any]:
        span = [self.edit.start, self.edit.end]
        return {"tokens": len(self.tokens), "span": span, "response": self.response}


def _splice(
    server: httpx.Client,
    reference: Engine,
    page: int,
    tag: str,
    replacement_text: str,
    aligned: bool = False,
) -> Spliced:
    """Splice the middle of a fresh session on the server, then generate after it.
    ``aligned``: the session holds whole pages and the replacement ends on a page boundary
    (on vLLM, no block to cache whole first); else neither."""
    tokens = list(reference.encode(prompt_text(tag)))
    replacement = list(reference.encode(replacement_text)) if replacement_text else []
    start = len(tokens) // 3
    if aligned:
        tokens = tokens[: floor_page(len(tokens), page)]
        start = floor_page(len(tokens) // 3 + len(replacement), page) - len(replacement)
    edit = Edit(start, start + CUT, tuple(replacement))
    session, base, body = edited_session(server, tokens, [directive(edit)])
    assert body["path"] == "splice" and body["fallback_reason"] is None, body
    assert body["rotated_tokens"] > 0, body
    new, revision = session_tokens(server, session)
    assert new == tokens[:start] + replacement + tokens[edit.end :] and revision == base + 1
    got = session_generate(server, session, new)
    assert got.cached_tokens >= plain_hit(len(new), page), "the spliced sequence should hit"
    return Spliced(tokens, edit, got, body)


def test_prefill_matches_reference(
    server: httpx.Client, reference: Engine, report_path: Path | None
) -> None:
    """The noise floor: no edit, the server's prefill vs the reference's."""
    tokens = list(reference.encode(prompt_text("prefill")))
    got = generate(server, tokens)
    delta = max_delta(got.top, reference_logprobs(reference, tokens))
    record(report_path, check="prefill (no edit)", max_delta_logprob=delta, tokens=len(tokens))
    assert delta <= TOLERANCE


@pytest.mark.parametrize(
    ("kind", "replacement", "aligned"),
    [("cut", "", True), ("replace", STUB, True), ("cut", "", False), ("replace", STUB, False)],
    ids=["cut-aligned", "replacement-aligned", "cut", "replacement"],
)
def test_splice_matches_reference_splice(
    server: httpx.Client,
    reference: Engine,
    page: int,
    report_path: Path | None,
    kind: str,
    replacement: str,
    aligned: bool,
) -> None:
    """A cut (no replacement): the downstream tokens' KV is rotated. With a replacement, it
    is prefilled in context first; the downstream tokens keep their old KV, rotated. Either
    way equal to the reference's splice of the same edit (protocol 3.1), whether or not the
    edit and the session line up with the cache's pages. The control: a fresh prefill of the
    edited tokens is far from it, so the bound tells kept KV from a recomputation."""
    s = _splice(server, reference, page, f"splice-{kind}", replacement, aligned)
    delta = max_delta(s.got.top, built_logprobs(reference, s.tokens, [s.edit]))
    control = max_delta(s.got.top, reference_logprobs(reference, s.new))
    record(
        report_path, check=f"splice ({kind}{', page-aligned' if aligned else ''})",
        max_delta_logprob=delta, vs_fresh_prefill=control, **s.facts(),
    )  # fmt: skip
    assert delta <= TOLERANCE
    assert control > 10 * TOLERANCE, "the splice reads as a prefill: the check cannot fail"


def test_tokens_appended_after_a_splice_see_its_last_token_recomputed(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None
) -> None:
    """Protocol 3.1: a moved last token is recomputed in its new context before anything
    follows it, also when the next request appends (SGLang leaves it out of its tree, so the
    longer prompt's generate computes it; vLLM's build computed it and the turn loads it):
    the distribution after the appended tokens equals the reference's."""
    from ._built import built_session

    tokens = list(reference.encode(prompt_text("splice-append")))
    edit = Edit(len(tokens) // 3, len(tokens) // 3 + CUT, ())
    session, _, body = edited_session(server, tokens, [directive(edit)])
    assert body["path"] == "splice" and body["fallback_reason"] is None, body
    new, _ = session_tokens(server, session)
    more = new + list(reference.encode(" Answer in one word:"))
    got = session_generate(server, session, more)
    assert plain_hit(len(new), page) <= got.cached_tokens <= len(new), got.report
    ref = built_session(reference, tokens, [edit])
    ref.prefill(more)
    delta = max_delta(got.top, torch.log_softmax(ref.next_token_logits().double(), -1))
    record(report_path, check="splice, then tokens appended", max_delta_logprob=delta)
    assert delta <= TOLERANCE


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
    got = generate(server, new)  # the forget re-prefilled the session: it hits the cache
    fresh = reference_logprobs(reference, new)
    forgot = reference_logprobs(reference, tokens, [Edit(start, end, (), Mode.forget)])
    delta = max_delta(got.top, fresh)
    record(report_path, check="forget vs fresh prefill", max_delta_logprob=delta)
    assert delta <= TOLERANCE
    assert max_delta(got.top, forgot) <= TOLERANCE  # the reference's forget is a re-prefill


def test_identity_edit_changes_nothing(server: httpx.Client, reference: Engine, page: int) -> None:
    tokens = list(reference.encode(prompt_text("identity")))
    session, base = create_session(server, tokens)
    before = generate(server, tokens)
    start, end = len(tokens) // 3, len(tokens) // 3 + CUT
    directive = {"verb": "splice", "span": {"start": start, "end": end}}
    reply = apply(server, session, base, [directive | {"replacement": tokens[start:end]}])
    assert reply.status_code == 200, reply.text
    assert session_tokens(server, session)[0] == tokens
    after = generate(server, tokens)
    assert after.cached_tokens == plain_hit(len(tokens), page)
    assert after.top == before.top  # the same cached KV, the same last-token forward


def test_rotation_off_fails_the_comparison(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None
) -> None:
    """Negative control: with the backend's rotation switched off, the splice must disagree
    with the reference. Passing only with the switch in place shows the comparison can fail."""
    how = (
        "start the server with it (and tests/live/_stubs/shims on its PYTHONPATH, as "
        "live_server.sh does) and pass the same value here"
    )
    with switched_on(ROTATION_OFF_FLAG, how):
        s = _splice(server, reference, page, "rotation-off", "", aligned=True)
    delta = max_delta(s.got.top, built_logprobs(reference, s.tokens, [s.edit]))
    check = "splice (cut), rotation OFF: must fail"
    record(report_path, check=check, max_delta_logprob=delta, **s.facts())
    assert delta > 10 * TOLERANCE, (
        f"with the rotation switched off the splice still matches (max |Δ| {delta:.2e}): the "
        "switch had no effect; is the leyline_live_shims plugin loaded in the server?"
    )
