"""Run one case through every arm on the reference engine and measure what each one did.

Arms (all end with the same question tokens, prefilled fresh, then read the yes/no margin):

* ``no_edit``: the old record (what the model decides before the change);
* ``field_only``: the old record's KV with only the field's tokens recomputed for the new
  value (a SPLICE of the field span: downstream KV kept as is, keys re-rotated if the
  value's token count differs);
* ``erratum``: the old record's KV untouched, the protocol's ERRATUM directive appends
  ``[STATE UPDATE] field -> new; overrides the earlier value.``;
* ``erratum_control``: the same note restating the *old* value, which separates the effect
  of the note's content from that of appending any note;
* ``oracle``: the prompt with the new value, recomputed from the record's first token (the
  template's rule and examples before it are the same tokens whatever the record holds).

Prefix-cache hit rates are measured on a second engine that shares the model and holds a
shared prefix cache: the earlier request (old record) is sent, then the edited prompt
arrives as a new request either with the erratum appended or with the field edited in
place. The hit rate is the engine's own ``reused / (reused + prefilled)`` for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leyline.core.report import OpReport
from leyline.engine.engine import Engine
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.session import SessionCache
from leyline.protocol import ErratumDirective, SpliceDirective, TokenSpan

from .templates import Case, Template

ARMS = ("no_edit", "field_only", "erratum", "erratum_control", "oracle")


@dataclass(frozen=True, slots=True)
class Options:
    """Token ids of the two answers; the decision margin is ``logit(yes) - logit(no)``."""

    yes: int
    no: int

    @classmethod
    def of(cls, engine: Engine) -> Options:
        yes, no = engine.encode(" yes"), engine.encode(" no")
        if len(yes) != 1 or len(no) != 1:  # a multi-token answer is not one constrained choice
            raise ValueError(f"' yes'/' no' must be single tokens, got {yes} / {no}")
        return cls(yes[0], no[0])

    def margin(self, logits: torch.Tensor) -> float:
        return float(logits[self.yes] - logits[self.no])

    def mass(self, logits: torch.Tensor) -> float:
        """Probability of either answer: how much of the model's choice the readout sees."""
        probs = torch.softmax(logits.float(), dim=-1)
        return float(probs[self.yes] + probs[self.no])


@dataclass(frozen=True, slots=True)
class Request:
    """A prompt sent to the prefix-cache engine as a new request, and what the engine did."""

    tokens: int
    reused: int
    prefilled: int
    path: str
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.reused / self.tokens

    @classmethod
    def of(cls, report: OpReport) -> Request:
        n = report.reused_tokens + report.prefilled_tokens
        return cls(
            n, report.reused_tokens, report.prefilled_tokens, report.path.value, report.seconds
        )


@dataclass(frozen=True, slots=True)
class CaseResult:
    """Every measurement of one case (``report.json`` holds one per case)."""

    template: str
    index: int
    old: str
    new: str
    rule_old: bool
    rule_new: bool
    margins: dict[str, float]
    """Arm -> logit(" yes") - logit(" no") after the question."""
    prompt_tokens: dict[str, int]
    """Arm -> tokens the decision was read after (prompt incl. the question)."""
    oracle_option_mass: float
    field_start: int
    field_tokens_old: int
    field_tokens_new: int
    note_tokens: int
    splice: dict[str, object]
    """The field-only SPLICE's report: path, reused, prefilled, rotated."""
    erratum_op: dict[str, object]
    """The ERRATUM directive's report: path, reused, prefilled."""
    field_kv_change: float
    """Max |value| change of the field's first token(s), field-only vs no-edit (all layers)."""
    field_kv_vs_oracle: float
    """Max |value| difference of the refreshed field vs the oracle's field (rounding only)."""
    downstream_kept: bool
    """The field-only arm's downstream values are bitwise the no-edit ones (kept, not redone)."""
    downstream_vs_oracle: float
    """Max |value| difference of the downstream tokens vs the oracle: their stale notes."""
    first_request: Request
    erratum_request: Request
    edit_request: Request
    first_request_margin: float
    erratum_request_margin: float
    edit_request_margin: float


def _values(kv: KVCache, start: int, end: int) -> list[torch.Tensor]:
    # Slot 1 holds the values in the GQA layout; values are never rotated, only copied.
    return [layer[1][..., start:end, :] for layer in kv]


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def _op(report: OpReport) -> dict[str, object]:
    return {
        "path": report.path.value,
        "reused": report.reused_tokens,
        "prefilled": report.prefilled_tokens,
        "rotated": report.rotated_tokens,
        "fallback_reason": None if report.fallback_reason is None else str(report.fallback_reason),
    }


class Runner:
    """Holds the two engines and one prefilled template head per template."""

    def __init__(self, engine: Engine, cached: Engine) -> None:
        if engine.prefix_cache is not None:
            raise ValueError(
                "the arms engine must have no prefix cache: arms reuse only their own KV"
            )
        if cached.prefix_cache is None:
            raise ValueError("the hit-rate engine needs a prefix cache")
        self.engine, self.cached = engine, cached
        self.options = Options.of(engine)
        self._heads: dict[str, tuple[tuple[int, ...], SessionCache]] = {}

    def _head(self, template: Template) -> tuple[tuple[int, ...], SessionCache]:
        # Rule and solved examples do not depend on the case: prefilled once per template.
        if template.name not in self._heads:
            tokens = self.engine.encode(template.head())
            session = SessionCache(self.engine)
            session.prefill(tokens)
            self._heads[template.name] = (tokens, session)
        return self._heads[template.name]

    def close(self) -> None:
        for _, session in self._heads.values():
            session.release()
        self._heads.clear()

    def run(self, case: Case) -> CaseResult:
        with torch.inference_mode():
            return self._run(case)

    def _run(self, case: Case) -> CaseResult:
        eng, opts, t = self.engine, self.options, case.template
        head, head_session = self._head(t)
        before, after = eng.encode(case.before), eng.encode(case.after)
        old, new = eng.encode(" " + case.old), eng.encode(" " + case.new)
        question = eng.encode(case.question)
        p_old, p_new = head + before + old + after, head + before + new + after
        start = len(head) + len(before)
        opened: list[SessionCache] = []

        def fork() -> SessionCache:
            opened.append(head_session.fork())
            return opened[-1]

        def decide(session: SessionCache) -> tuple[float, int]:
            session.extend(question)
            return opts.margin(session.next_token_logits()), len(session.tokens)

        try:
            base = fork()
            base.extend(p_old[len(head) :])
            margins: dict[str, float] = {}
            sizes: dict[str, int] = {}

            field = base.fork()
            opened.append(field)
            splice = field.apply_directives(
                [
                    SpliceDirective(
                        span=TokenSpan(start=start, end=start + len(old)), replacement=list(new)
                    )
                ]
            )
            field_kv = field.kv  # before the question is appended: the prompt's KV only

            notes: dict[str, tuple[int, ...]] = {}
            erratum_op: OpReport | None = None
            for arm, value in (("erratum", case.new), ("erratum_control", case.old)):
                session = base.fork()
                opened.append(session)
                directive = ErratumDirective.for_field(
                    t.field, value, corrects=TokenSpan(start=start, end=start + len(old))
                )
                report = session.apply_directives([directive])
                erratum_op = erratum_op or report
                notes[arm] = session.tokens[len(p_old) :]
                margins[arm], sizes[arm] = decide(session)

            # Everything from the record's first token is prefilled afresh; only the template
            # head (rule and examples, before the record, unable to see it) is the shared
            # exact KV of the same tokens. ``first_request`` checks that this equals a
            # from-scratch prefill.
            oracle = fork()
            full = oracle.extend(p_new[len(head) :] + question)
            if full.reused_tokens != len(head):
                raise RuntimeError(f"oracle reused {full.reused_tokens} of {len(head)} tokens")
            oracle_logits = oracle.next_token_logits()
            margins["oracle"], sizes["oracle"] = opts.margin(oracle_logits), len(p_new + question)

            down_old, down_new = start + len(old), start + len(new)
            kept = _values(field_kv, down_new, len(p_new))
            field_kv_change = _max_diff(
                _values(field_kv, start, start + min(len(old), len(new))),
                _values(base.kv, start, start + min(len(old), len(new))),
            )
            field_vs_oracle = _max_diff(
                _values(field_kv, start, down_new), _values(oracle.kv, start, down_new)
            )
            downstream_kept = all(
                torch.equal(a, b)
                for a, b in zip(kept, _values(base.kv, down_old, len(p_old)), strict=True)
            )
            downstream_vs_oracle = _max_diff(kept, _values(oracle.kv, down_new, len(p_new)))

            margins["field_only"], sizes["field_only"] = decide(field)
            margins["no_edit"], sizes["no_edit"] = decide(base)
        finally:
            for session in opened:
                session.release()

        requests = self.send_requests(p_old, p_new, notes["erratum"], question)
        assert erratum_op is not None
        return CaseResult(
            template=t.name,
            index=case.index,
            old=case.old,
            new=case.new,
            rule_old=t.answer(case.old),
            rule_new=t.answer(case.new),
            margins={arm: margins[arm] for arm in ARMS},
            prompt_tokens={arm: sizes[arm] for arm in ARMS},
            oracle_option_mass=opts.mass(oracle_logits),
            field_start=start,
            field_tokens_old=len(old),
            field_tokens_new=len(new),
            note_tokens=len(notes["erratum"]),
            splice=_op(splice),
            erratum_op=_op(erratum_op),
            field_kv_change=field_kv_change,
            field_kv_vs_oracle=field_vs_oracle,
            downstream_kept=downstream_kept,
            downstream_vs_oracle=downstream_vs_oracle,
            first_request=requests[0][0],
            erratum_request=requests[1][0],
            edit_request=requests[2][0],
            first_request_margin=requests[0][1],
            erratum_request_margin=requests[1][1],
            edit_request_margin=requests[2][1],
        )

    def send_requests(
        self,
        p_old: tuple[int, ...],
        p_new: tuple[int, ...],
        note: tuple[int, ...],
        question: tuple[int, ...],
    ) -> list[tuple[Request, float]]:
        """The earlier request, then the edited prompt as (i) erratum, (ii) in-prefix edit."""
        out: list[tuple[Request, float]] = []
        sessions: list[SessionCache] = []
        try:
            for tokens in (p_old + question, p_old + note + question, p_new + question):
                session = SessionCache(self.cached)
                sessions.append(session)
                report = session.prefill(tokens)
                out.append((Request.of(report), self.options.margin(session.next_token_logits())))
        finally:
            # Closing releases each session's hold; the blocks stay cached (LRU) for reuse.
            for session in sessions:
                session.release()
        return out
