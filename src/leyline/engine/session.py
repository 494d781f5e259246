"""SessionCache: one agent's cached sequence, edited with directives instead of re-prefilled.

Three kinds of work: prefill (reusing the session's own KV and the shared prefix cache),
generation, and :meth:`SessionCache.execute` of a checked edit plan (``core.batch``; the
``apply_*`` and ``compose`` methods only plan in front of it). Each runs under the session
lock and swaps a new ``SessionState`` in at the end: a failed batch changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from leyline.core.backend import EXECUTED_VERBS
from leyline.core.batch import (
    EditPlan,
    SessionView,
    check_tokens,
    common_prefix,
    plan_batch,
    plan_edits,
)
from leyline.core.lineage import Lineages
from leyline.core.report import OpReport
from leyline.core.turns import GenerationResult, SamplingParams
from leyline.engine.edits.compose import plan_compose, run_batch
from leyline.engine.edits.edit_paths import run_edits
from leyline.engine.edits.run_executor import slice_kv
from leyline.engine.edits.skills import Skill
from leyline.engine.engine import Engine
from leyline.engine.generation import Decoder, OnToken
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.kv.prefix_cache import LockHandle
from leyline.engine.session_state import SessionState
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Directive, Mode, Recompute
from leyline.protocol.envelope import Path
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.spans import MessageSpan

RunPlan = Callable[[SessionState], tuple[SessionState, OpReport]]
"""A plan's execution on a complete state: the new state (revision, spans set by the
session) and its report."""


class SessionCache:
    """One cached sequence on the reference engine: standalone (benchmarks, evals) or as
    the handle of a core session (``engine_backend``)."""

    def __init__(self, engine: Engine, *, salt: str = "") -> None:
        self.engine = engine
        self.salt = salt
        """The shared prefix cache's partition this session reads and feeds (its tenant's)."""
        self._state = SessionState()
        self._lock = threading.RLock()
        self._handle: LockHandle | None = None  # our exact prefix, held in the prefix cache
        self._lineages = Lineages()  # what we published, and where it is now (FORGET)

    # -- read-only views -----------------------------------------------------------------

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._state.tokens

    @property
    def revision(self) -> int:
        return self._state.revision

    @property
    def spans(self) -> tuple[MessageSpan, ...]:
        return self._state.spans

    @property
    def kv(self) -> KVCache:
        return self._state.kv

    @property
    def view(self) -> SessionView:
        state = self._state
        return SessionView(state.tokens, state.revision, state.spans)

    # -- prefill -------------------------------------------------------------------------

    def prefill(
        self, tokens: Sequence[int], *, spans: Sequence[MessageSpan] = (), reserve: int = 0
    ) -> OpReport:
        """Make ``tokens`` the cached sequence, reusing the longest cached prefix.

        ``reserve``: when new KV is computed, leave room for that many more positions in
        its buffers, so that a generation of up to ``reserve`` tokens decodes into them
        instead of copying the cache once more (:meth:`begin_generation`)."""
        with self._lock:
            t0 = time.perf_counter()
            state = self._state
            new_tokens = tuple(int(t) for t in tokens)
            check_tokens(new_tokens, self.engine.vocab_size, self.engine.limits, "tokens")
            new_state, report = self._prefill_state(state, new_tokens, tuple(spans), reserve)
            if new_tokens[: len(state.tokens)] != state.tokens:
                self._lineages.realigned(state.tokens, new_tokens)
            self._commit(new_state)
            return _timed(report, t0)

    def prefill_text(self, text: str) -> OpReport:
        return self.prefill(self.engine.encode(text))

    def extend(self, tokens: Sequence[int]) -> OpReport:
        with self._lock:
            return self.prefill(self._state.tokens + tuple(tokens), spans=self._state.spans)

    def _prefill_state(
        self,
        state: SessionState,
        tokens: tuple[int, ...],
        spans: tuple[MessageSpan, ...],
        reserve: int = 0,
    ) -> tuple[SessionState, OpReport]:
        n = len(tokens)
        if n == 0:
            return SessionState(revision=state.revision + 1, spans=spans), OpReport(
                Path.reprefill, state.revision + 1, 0, 0
            )
        same = tokens == state.tokens and state.logits is not None
        if same and state.kv_length == n:
            new = SessionState(
                tokens,
                state.kv,
                state.logits,
                state.revision,
                spans or state.spans,
                state.exact_length,
                state.owns_kv,
            )
            return new, OpReport(Path.prefix_hit, state.revision, n, 0, first_change=n)
        # At least the last token is run again: its logits are what generation needs.
        reuse = min(common_prefix(state.tokens[: state.kv_length], tokens), n - 1)
        if state.logits is None and state.tokens and state.kv_length == len(state.tokens):
            # One rule after a splice that ended in a kept run: the sequence's last token is
            # recomputed in its new context before anything follows it, whether the next
            # request asks for logits right away or appends first (docs/protocol.md, 3.1).
            reuse = min(reuse, len(state.tokens) - 1)
        base, exact = slice_kv(state.kv, 0, reuse), min(reuse, state.exact_length)
        extends = state.tokens == tokens[: len(state.tokens)]
        cache = self.engine.prefix_cache
        if cache is not None:
            hit = cache.match(tokens, salt=self.salt)
            usable = min(hit.matched_tokens, n - 1)
            if hit.kv is not None and usable > reuse:
                base, reuse, exact, extends = slice_kv(hit.kv, 0, usable), usable, usable, True
        cap = self.engine.limits.max_session_tokens  # no generation goes past it
        room = reserve if cap is None else max(0, min(reserve, cap - n))
        kv, logits = self.engine.forward(base, tokens[reuse:], reserve=room)
        revision = state.revision if tokens == state.tokens else state.revision + 1
        exact = n if exact == reuse else exact
        new = SessionState(tokens, kv, logits, revision, spans, exact, owns_kv=True)
        # Nothing reused (a fresh session, no shared prefix) is a prefill, not a hit.
        path = Path.prefix_hit if extends and reuse > 0 else Path.reprefill
        return new, OpReport(path, revision, reuse, n - reuse, first_change=reuse)

    # -- generation ----------------------------------------------------------------------

    def next_token_logits(self) -> torch.Tensor:
        """fp32 logits for the token after the cached sequence (computed if not known)."""
        with self._lock:
            state = self._ensure_logits(self._state)
            self._commit(state)
            assert state.logits is not None
            return state.logits

    def _ensure_logits(self, state: SessionState) -> SessionState:
        if state.logits is not None and state.kv_length == len(state.tokens):
            return state
        if not state.tokens:
            raise LeylineError(ErrorCode.invalid_directive, "the session holds no tokens yet")
        # Pending tokens (the last sampled one), or a last token whose KV was kept across a
        # splice: run it again in the current context to get its logits.
        start = min(state.kv_length, len(state.tokens) - 1)
        kv, logits = self.engine.forward(slice_kv(state.kv, 0, start), state.tokens[start:])
        exact = len(state.tokens) if state.exact_length >= start else state.exact_length
        return SessionState(state.tokens, kv, logits, state.revision, state.spans, exact, True)

    def generate(
        self, params: SamplingParams | None = None, *, on_token: OnToken | None = None
    ) -> GenerationResult:
        """Sample after the cached sequence; the generated tokens join the session.

        ``on_token`` is called with every token as it is chosen; returning False stops the
        generation there (finish reason ``stop``). Decode steps write into one buffer sized
        for the whole generation, so a step never copies the cache.
        """
        with self._lock:
            return self.generate_pending(self.begin_generation(params, on_token=on_token))

    def generate_pending(self, pending: PendingGeneration) -> GenerationResult:
        """Step a begun generation alone, one forward per token, and commit it."""
        with self._lock:
            decoder = pending.decoder
            while decoder.choose():
                logits = self.engine.forward_into(
                    decoder.buffers, decoder.length, [decoder.pending]
                )
                decoder.advance(logits)
            return self.finish_generation(pending)

    def begin_generation(
        self, params: SamplingParams | None = None, *, on_token: OnToken | None = None
    ) -> PendingGeneration:
        """A generation after the cached sequence, not yet run: its :class:`Decoder` is
        stepped by the caller (alone, or batched with other sessions' by the scheduler),
        then :meth:`finish_generation` commits it. The session is unchanged until then.

        Where the session owns its KV buffers and they have room for the whole budget (a
        ``prefill(..., reserve=)``), the decoder writes past the session's KV in those same
        buffers instead of copying the cache; until it commits, the session then marks its
        KV shared (no in-place edit may move it under the decoder)."""
        params = params or SamplingParams()
        with self._lock:
            t0 = time.perf_counter()
            before = self._state
            state = self._ensure_logits(before)
            pending = len(before.tokens) - min(before.kv_length, len(before.tokens))
            prefill = OpReport(
                Path.prefix_hit, before.revision, len(before.tokens) - pending, pending
            )
            lend = state is before and before.owns_kv
            decoder = Decoder(self.engine, state, params, on_token, in_place=lend)
            if decoder.in_place:
                self._state = before = replace(before, owns_kv=False)
            return PendingGeneration(self, before, decoder, prefill, t0)

    def finish_generation(self, pending: PendingGeneration) -> GenerationResult:
        """Commit a generation begun on this session: its tokens join the session."""
        with self._lock:
            if pending.session is not self or not _unchanged(self._state, pending.before):
                raise RuntimeError("the session changed while its generation ran")
            # Decoded in the session's own buffers: still its alone unless forked since.
            alone = not pending.decoder.in_place or self._state is pending.before
            done = pending.decoder.result(owns_kv=alone)
            self._commit(done.state)
            out = done.tokens
            stops = pending.decoder.stops
            shown = out[:-1] if out and out[-1] in stops else out
            text = self.engine.decode(shown)
            if done.cut is not None:
                text = text[: done.cut]
            return GenerationResult(
                tuple(out),
                text,
                done.finish,
                done.state.revision,
                pending.prefill,
                time.perf_counter() - pending.started,
                tuple(done.choices),
            )

    # -- edits -----------------------------------------------------------------------------

    def apply_directives(
        self,
        directives: Sequence[Directive],
        *,
        base_revision: int | None = None,
        allow_fallback: bool = True,
        want_logits: bool = False,
    ) -> OpReport:
        """Plan a protocol batch (anchors, text; every rule checked) and execute it."""
        with self._lock:
            plan = plan_batch(
                self.view,
                directives,
                tokenize=self.engine.encode,
                limits=self.engine.limits,
                vocab_size=self.engine.vocab_size,
                supported=EXECUTED_VERBS,
                base_revision=base_revision,
            )
            return self.execute(plan, allow_fallback=allow_fallback, want_logits=want_logits)

    def apply_edits(
        self,
        edits: Sequence[Edit],
        *,
        base_revision: int | None = None,
        allow_fallback: bool = True,
        want_logits: bool = False,
    ) -> OpReport:
        """Plan resolved token edits (every rule checked) and execute them."""
        with self._lock:
            plan = plan_edits(
                self.view,
                edits,
                limits=self.engine.limits,
                vocab_size=self.engine.vocab_size,
                base_revision=base_revision,
            )
            return self.execute(plan, allow_fallback=allow_fallback, want_logits=want_logits)

    def execute(
        self,
        plan: EditPlan,
        *,
        allow_fallback: bool = True,
        want_logits: bool = False,
        skills: Mapping[int, Skill] | None = None,
        final_tokens: Sequence[int] | None = None,
    ) -> OpReport:
        """Execute a checked plan all-or-nothing; returns what ran (splice / reprefill).

        ``want_logits``: also compute the next-token logits now (one decode step inside the
        splice's own buffer) rather than on first use, which would copy the new KV once.
        ``skills``: the compiled skill of each of ``plan.composes``, by directive index.
        ``final_tokens``: the sequence the request goes on to (a turn's prompt); a compose
        with ``attention`` recompute is ranked by its tokens after the block.

        Raises:
            LeylineError: ``revision_conflict`` if the session moved since the plan;
                ``skill_mismatch`` for a skill of another model.
            SpliceUnsupportedError: the splice cannot run exactly and ``allow_fallback`` is
                false; nothing changed.
        """
        blocks = dict(skills or {})
        missing = [c.index for c in plan.composes if c.index not in blocks]
        if missing:
            raise ValueError(f"no compiled skill for the composes at {missing}")

        def run(state: SessionState) -> tuple[SessionState, OpReport]:
            if plan.composes:
                return run_batch(
                    self.engine, state, plan, blocks,
                    allow_fallback=allow_fallback, want_logits=want_logits,
                    final_tokens=final_tokens,
                )  # fmt: skip
            return run_edits(
                self.engine.splicer, state, plan.result, forget=plan.forget_from is not None,
                allow_fallback=allow_fallback, want_logits=want_logits,
            )  # fmt: skip

        return self._execute(plan, run)

    def compose(
        self,
        skill: Skill,
        at: int,
        *,
        seam_tokens: int = 4,
        base_revision: int | None = None,
        allow_fallback: bool = True,
        want_logits: bool = False,
        recompute_ratio: float | None = None,
        recompute: Recompute | None = None,
        final_tokens: Sequence[int] | None = None,
    ) -> OpReport:
        """Insert ``skill``'s precomputed KV at token position ``at``: a one-compose batch
        (``compose.plan_compose``) through :meth:`execute`. ``recompute_ratio``: a deviation
        recompute of that fraction of the copied tokens; ``recompute``: any mode instead."""
        with self._lock:
            plan = plan_compose(
                self.view, skill, at, seam_tokens,
                limits=self.engine.limits, vocab_size=self.engine.vocab_size,
                base_revision=base_revision, recompute_ratio=recompute_ratio,
                recompute=recompute,
            )  # fmt: skip
            return self.execute(
                plan, allow_fallback=allow_fallback, want_logits=want_logits,
                skills={0: skill}, final_tokens=final_tokens,
            )  # fmt: skip

    def _execute(self, plan: EditPlan, run: RunPlan) -> OpReport:
        """Run ``plan`` on the complete state and swap the result in (revision + 1)."""
        with self._lock:
            t0 = time.perf_counter()
            state = self._state
            if plan.base != self.view:
                raise LeylineError(
                    ErrorCode.revision_conflict,
                    f"the batch was planned against revision {plan.base.revision}; the "
                    f"session is at {state.revision}",
                    "base_revision",
                )
            if plan.is_identity:
                n = len(state.tokens)
                return _timed(OpReport(Path.splice, state.revision, n, 0, first_change=n), t0)
            new, report = run(self._complete(state))
            new = replace(new, revision=state.revision + 1, spans=plan.spans)
            spans_forgotten = [(e.start, e.end) for e in plan.edits if e.mode is Mode.forget]
            lineages = self._lineages.forgotten(spans_forgotten)  # in the old coordinates
            self._lineages.moved(plan.result.position_map)
            self._commit(new, purge_from=plan.forget_from, old=state.tokens, lineages=lineages)
            return _timed(report, t0)

    def _complete(self, state: SessionState) -> SessionState:
        """``state`` with KV for every token (pending ones prefilled); not committed."""
        if state.kv_length == len(state.tokens):
            return state
        kv, logits = self.engine.forward(state.kv, state.tokens[state.kv_length :])
        exact = len(state.tokens) if state.exact_length >= state.kv_length else state.exact_length
        return SessionState(state.tokens, kv, logits, state.revision, state.spans, exact, True)

    # -- commit and the shared prefix cache ----------------------------------------------------

    def _commit(
        self,
        new: SessionState,
        *,
        purge_from: int | None = None,
        old: tuple[int, ...] = (),
        lineages: Sequence[tuple[tuple[int, ...], int]] = (),
    ) -> None:
        self._state = new
        cache = self.engine.prefix_cache
        if cache is None:
            return
        if purge_from is not None and purge_from < len(old):
            # FORGET: drop every shared block derived from the forgotten span (blocks other
            # sessions hold are doomed); our own hold is released first so it cannot keep any.
            cache.purge(old, purge_from, release=self._handle, salt=self.salt)
            self._handle = None
        for published, first in lineages:  # what earlier revisions published of the span
            if first < len(published):
                cache.purge(published, first, salt=self.salt)
        # Publish only the exact prefix, hold it for as long as it is ours, then let go of
        # the previous hold (after, so shared blocks are never unreferenced in between).
        previous, self._handle = self._handle, None
        exact = min(new.exact_length, new.kv_length)
        if exact >= cache.block_size:
            held = cache.insert(
                new.tokens[:exact], slice_kv(new.kv, 0, exact), lock=True, salt=self.salt
            )
            self._handle = held.handle
            self._lineages.published(new.tokens[: held.stored_tokens])
        if previous is not None:
            cache.unlock(previous)

    def fork(self, *, copy_kv: bool = False) -> SessionCache:
        """A new session starting from this one's state, for branching agents and for
        benchmarks; the two then evolve independently. By default they share the KV
        tensors, which neither then edits in place (each edit copies, see
        ``SessionState.owns_kv``); ``copy_kv`` gives the new session its own copy instead,
        which its edits may then move in place (one copy now instead of one per edit)."""
        with self._lock:
            state = self._state
            other = SessionCache(self.engine, salt=self.salt)
            other._lineages = self._lineages.copy()
            if copy_kv and state.kv:
                kv = tuple(tuple(t.clone() for t in layer) for layer in state.kv)
                other._commit(replace(state, kv=kv, owns_kv=True))
            else:
                self._state = state = replace(state, owns_kv=False)
                other._commit(state)
            return other

    def release(self) -> None:
        """Let go of the session's hold on shared prefix blocks (on close)."""
        with self._lock:
            if self._handle is not None and self.engine.prefix_cache is not None:
                self.engine.prefix_cache.unlock(self._handle)
            self._handle = None


def _unchanged(now: SessionState, before: SessionState) -> bool:
    """Whether ``now`` is ``before``, or ``before`` marked shared by a fork since."""
    if now is before:
        return True
    fields = ("tokens", "kv", "logits", "spans")
    same = all(getattr(now, f) is getattr(before, f) for f in fields)
    return same and (now.revision, now.exact_length) == (before.revision, before.exact_length)


def _timed(report: OpReport, t0: float) -> OpReport:
    return replace(report, seconds=time.perf_counter() - t0)


@dataclass(frozen=True, slots=True)
class PendingGeneration:
    """A generation begun on ``session`` from state ``before``; ``decoder`` holds its work."""

    session: SessionCache
    before: SessionState
    decoder: Decoder
    prefill: OpReport
    """How the context was brought up to date before the first token."""
    started: float
