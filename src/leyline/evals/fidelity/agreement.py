"""Splice vs full context vs re-prefill: next-token KL and argmax, one prompt at a time.

- full context: the original sequence prefilled by the engine (its next-token logits);
- re-prefill: the edited sequence run from scratch by a plain transformers forward (no
  engine code, no cache): the independent reference;
- splice: the engine's AMORTIZE splice of the original session (span -> stub, downstream
  KV kept and re-rotated), then its next-token logits (the last token run again in the
  new context, as the engine does);
- control: the same splice with a zero rotation (downstream keys left at their old
  positions), to show what the rotation buys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leyline.engine.edits.run_executor import execute_edit
from leyline.engine.engine import Engine
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.rope import RopeSpec
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit, apply_edits
from leyline.protocol.directives import Mode

from .measures import kl
from .tokens import TokenizedPrompt


@dataclass(frozen=True, slots=True)
class PromptRecord:
    id: str
    kind: str
    length: int
    span_start: int
    span_end: int
    stub_length: int
    delta: int
    path: str
    """What the engine ran for the splice: ``splice`` (anything else is a fallback)."""
    kl_splice_vs_full: float
    kl_splice_vs_reprefill: float
    kl_reprefill_vs_full: float
    kl_control_vs_reprefill: float
    argmax_full: int
    argmax_reprefill: int
    argmax_splice: int
    argmax_control: int
    answer_token: int | None

    @property
    def diverges(self) -> bool:
        """Full context and re-prefill predict different next tokens."""
        return self.argmax_full != self.argmax_reprefill

    @property
    def follows(self) -> str:
        """Which one the splice's argmax equals: full, reprefill, both or neither."""
        full = self.argmax_splice == self.argmax_full
        re = self.argmax_splice == self.argmax_reprefill
        return "both" if full and re else "full" if full else "reprefill" if re else "neither"


def plain_forward_logits(engine: Engine, tokens: tuple[int, ...]) -> torch.Tensor:
    """Next-token logits of ``tokens`` by transformers alone (no cache, no engine path)."""
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=engine.model.device)
    out = engine.model(input_ids=ids, use_cache=False, logits_to_keep=1)
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits


@dataclass(frozen=True, slots=True)
class Compared:
    record: PromptRecord
    before: KVCache
    """The original sequence's KV (the engine's prefill)."""
    after: KVCache
    """The KV after the splice; its last position was run again for the logits."""


def compare_prompt(engine: Engine, tp: TokenizedPrompt) -> Compared:
    session = SessionCache(engine)
    try:
        session.prefill(tp.tokens)
        full = session.next_token_logits()
        # a copy: the splice runs inside the session's own buffers (``in_place_edit``), as a
        # server's does, and moves what ``session.kv`` showed before it
        original_kv = tuple(tuple(t.clone() for t in layer) for layer in session.kv)
        reprefill = plain_forward_logits(engine, tp.edited)
        edit = Edit(tp.start, tp.end, tp.stub, Mode.amortize)
        report = session.apply_edits([edit], want_logits=True)
        splice = session.next_token_logits()
        spliced_kv = session.kv
        if session.tokens != tp.edited:
            raise AssertionError(f"{tp.prompt.id}: the splice produced other tokens")
        control = _unrotated_splice_logits(engine, original_kv, tp, edit)
    finally:
        session.release()
    record = PromptRecord(
        id=tp.prompt.id,
        kind=tp.prompt.kind,
        length=len(tp.tokens),
        span_start=tp.start,
        span_end=tp.end,
        stub_length=len(tp.stub),
        delta=tp.delta,
        path=report.path.value,
        kl_splice_vs_full=kl(full, splice),
        kl_splice_vs_reprefill=kl(reprefill, splice),
        kl_reprefill_vs_full=kl(full, reprefill),
        kl_control_vs_reprefill=kl(reprefill, control),
        argmax_full=int(full.argmax()),
        argmax_reprefill=int(reprefill.argmax()),
        argmax_splice=int(splice.argmax()),
        argmax_control=int(control.argmax()),
        answer_token=tp.answer_token,
    )
    return Compared(record, original_kv, spliced_kv)


def _unrotated_splice_logits(
    engine: Engine, kv: KVCache, tp: TokenizedPrompt, edit: Edit
) -> torch.Tensor:
    """The engine's splice executor with every frequency zero: kept keys are not rotated."""
    assert engine.rope is not None and engine.layout is not None
    zero = RopeSpec(engine.rope.rope_type, torch.zeros_like(engine.rope.inv_freq), 1.0)
    result = apply_edits(tp.tokens, [edit])
    out = execute_edit(
        engine.forwards,
        engine.layout,
        zero,
        kv,
        result,
        old_exact_length=len(tp.tokens),
        want_logits=True,
    )
    logits: torch.Tensor | None = out.logits
    assert logits is not None
    return logits
