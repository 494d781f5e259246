"""What a backend living inside another serving engine (SGLang, vLLM) shares: the engine's
tokenizer and limits, text <-> tokens, the reference server's chat rendering over that
tokenizer, and session handles whose KV the engine's cache owns (``SaltedSession``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Generic, TypeVar

from leyline.core.batch import EditPlan, SessionView, common_prefix
from leyline.core.chat.render import BackendRenderer
from leyline.core.report import OpReport
from leyline.core.salted_session import SaltedSession
from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.capabilities import Limits
from leyline.protocol.envelope import Path
from leyline.protocol.fallback import FallbackReason
from leyline.protocol.spans import MessageSpan

S = TypeVar("S", bound=SaltedSession)


class HostBackend(Generic[S]):
    def __init__(
        self,
        tokenizer: Any | None,
        *,
        limits: Limits,
        vocab_size: int,
        model_name: str,
        stop_token_ids: Collection[int],
        missing_tokenizer: str,
    ) -> None:
        self._tokenizer = tokenizer
        self._limits = limits
        self._vocab_size = vocab_size
        self.model_name = model_name
        self._stops = tuple(stop_token_ids)
        # The reference server's rendering over the engine's own (HF) tokenizer: same
        # template, same message spans, so message anchors resolve as they do there.
        self.renderer = BackendRenderer(tokenizer, missing_tokenizer)

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    @property
    def stop_token_ids(self) -> Collection[int]:
        return self._stops

    def encode(self, text: str) -> tuple[int, ...]:
        if self._tokenizer is None:
            raise LeylineError(ErrorCode.invalid_directive, self.renderer.missing, "text")
        return tuple(int(t) for t in self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        if self._tokenizer is None:
            return " ".join(str(t) for t in tokens)
        return str(self._tokenizer.decode(list(tokens), skip_special_tokens=False))

    def view(self, handle: S) -> SessionView:
        return handle.view

    def nbytes(self, handle: S) -> int:
        return 0  # the engine's cache owns the KV (evicted LRU); a session pins nothing

    async def prefill(
        self, handle: S, tokens: Sequence[int], spans: Sequence[MessageSpan]
    ) -> OpReport:
        old, new = handle.view, tuple(int(t) for t in tokens)
        if new[: len(old.tokens)] != old.tokens:
            handle.realigned(old.tokens, new)
        await self.cache_prompt(handle, new)
        handle.cached(new)
        shared = common_prefix(old.tokens, new)
        revision = old.revision if new == old.tokens else old.revision + 1
        handle.view = SessionView(new, revision, tuple(spans))
        # Nothing reused (a fresh session) is a prefill, not a hit.
        path = Path.prefix_hit if shared == len(old.tokens) and shared > 0 else Path.reprefill
        return OpReport(path, revision, shared, len(new) - shared, first_change=shared)

    async def cache_prompt(self, handle: S, tokens: tuple[int, ...]) -> None:
        """Have the engine compute and cache ``tokens`` where ``handle``'s KV is (none: a
        no-op)."""
        raise NotImplementedError


def private_namespaces(handle: SaltedSession) -> list[tuple[str, tuple[int, ...]]]:
    """The namespaces only this session reads (left ones, and its current private one), with
    the tokens cached in each: what closing the session purges."""
    private = list(handle.abandoned)
    if handle.private_salt is not None:
        private.append((handle.private_salt, handle.view.tokens))
    return private


def edit_report(
    plan: EditPlan,
    path: Path,
    reused: int,
    rotated: int,
    reason: FallbackReason | None = None,
) -> OpReport:
    """The report of an edit that kept ``reused`` tokens' KV (``rotated`` of them moved) and
    had the engine compute the rest of the new sequence."""
    n = len(plan.tokens)
    reused = min(reused, n)
    return OpReport(
        path,
        plan.base.revision + 1,
        reused_tokens=reused,
        prefilled_tokens=n - reused,
        rotated_tokens=rotated,
        first_change=plan.result.first_change,
        fallback_reason=reason,
    )
