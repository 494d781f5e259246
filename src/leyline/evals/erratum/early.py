"""Field-early layout: the record at the top of a long static prompt; prefix-cache hits only.

The decision prompts put the field after the rule and the solved examples (~93% of the
prompt), so an in-prefix edit still reuses most of it. Agent prompts in the paper's
benchmark have the other shape: a state block first, then long text that does not depend on
it (instructions, documents, history). Here the same record sits on the prompt's first lines,
followed by the template's rule and the static body of :mod:`.body`, and the question label.

Measured exactly as in the decision layout (:meth:`.arms.Runner.send_requests`): the earlier
request (old record) is sent to the prefix-cache engine, then the updated prompt arrives as
a new request with (i) the erratum appended at the end or (ii) the field edited in place,
and the hit rate is the engine's ``reused / (reused + prefilled)``. There is no decision
readout: SmolLM2-135M's few-shot decision needs the solved examples right before the query.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leyline.protocol import ErratumDirective

from .arms import Request, Runner
from .stats import hit_summary
from .templates import Case

TITLE = "Current record (from the case system):\n"


@dataclass(frozen=True, slots=True)
class EarlyResult:
    """One case in the field-early layout (``report.json`` ``field_early_records``)."""

    template: str
    index: int
    old: str
    new: str
    field_start: int
    """Tokens before the field's value (the in-prefix edit cannot reuse past this)."""
    prompt_tokens: int
    """The old prompt without the question: what the erratum request can reuse."""
    body_tokens: int
    note_tokens: int
    question_tokens: int
    first_request: Request
    erratum_request: Request
    edit_request: Request


def parts(case: Case, body: str) -> tuple[str, str]:
    """The text before and after the field's value: record first, then rule and body."""
    return TITLE + case.before, f"{case.after}\n{case.template.rule}\n\n{body}\n\n"


def run_early(runner: Runner, case: Case, body: str) -> EarlyResult:
    """Send the three requests of ``case`` in the field-early layout; no decision is read."""
    eng = runner.cached
    before, after = (eng.encode(text) for text in parts(case, body))
    old, new = eng.encode(" " + case.old), eng.encode(" " + case.new)
    # The session tokenizes the directive's text on its own, as encode() does here.
    text = ErratumDirective.for_field(case.template.field, case.new).text
    assert isinstance(text, str)  # a field's note is text, never token ids
    note = eng.encode(text)
    question = eng.encode(case.question)
    with torch.inference_mode():
        first, erratum, edit = (
            request
            for request, _ in runner.send_requests(
                before + old + after, before + new + after, note, question
            )
        )
    return EarlyResult(
        template=case.template.name,
        index=case.index,
        old=case.old,
        new=case.new,
        field_start=len(before),
        prompt_tokens=len(before + old + after),
        body_tokens=len(eng.encode(body)),
        note_tokens=len(note),
        question_tokens=len(question),
        first_request=first,
        erratum_request=erratum,
        edit_request=edit,
    )


def _group(results: Sequence[EarlyResult]) -> dict[str, Any]:
    return {
        "cases": len(results),
        "field_position": _median([r.field_start / r.edit_request.tokens for r in results]),
        "prompt_tokens": _median([r.edit_request.tokens for r in results]),
        "body_tokens": _median([r.body_tokens for r in results]),
        "hit_rate": {
            "first_request": hit_summary([r.first_request for r in results]),
            "erratum": hit_summary([r.erratum_request for r in results]),
            "in_prefix_edit": hit_summary([r.edit_request for r in results]),
        },
    }


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize_early(results: Sequence[EarlyResult]) -> dict[str, Any]:
    """Hit rates per template and overall, shaped like the decision layout's ``hit_rate``."""
    names = list(dict.fromkeys(r.template for r in results))
    return {
        "templates": {name: _group([r for r in results if r.template == name]) for name in names},
        "overall": _group(results),
    }
