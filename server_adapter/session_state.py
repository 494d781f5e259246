"""A session's whole state as one immutable value, so a change is a single assignment.

Every operation computes a new :class:`SessionState` from the current one (tensors are
never written in place) and swaps it in at the end. An operation that raises has swapped
nothing: tokens, KV and revision stay bitwise as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leyline.protocol.capabilities import Limits
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.spans import MessageSpan

from .forward import kv_length
from .kv_blocks import KVCache


@dataclass(frozen=True, slots=True)
class SessionState:
    tokens: tuple[int, ...] = ()
    kv: KVCache = ()
    """KV of ``tokens[:kv_length]``; the rest (at most the last sampled token) is pending."""
    logits: torch.Tensor | None = None
    """Next-token logits after all of ``tokens``, when known (KV complete and last token
    computed in the current context)."""
    revision: int = 0
    spans: tuple[MessageSpan, ...] = ()
    exact_length: int = 0
    """Prefix whose KV equals a fresh prefill's; only it may enter the shared prefix cache
    (AMORTIZE keeps the influence of removed tokens downstream, which no other session
    sharing the same tokens should inherit)."""

    @property
    def kv_length(self) -> int:
        return kv_length(self.kv)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_tokens(tokens: Sequence[int], vocab_size: int, limits: Limits, field: str) -> None:
    """Token ids in the vocabulary and a sequence within the session limit."""
    cap = limits.max_session_tokens
    if cap is not None and len(tokens) > cap:
        raise LeylineError(
            ErrorCode.session_too_long,
            f"the sequence would be {len(tokens)} tokens; this model takes at most {cap}",
            field,
        )
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            field,
        )
