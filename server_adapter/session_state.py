"""A session's whole state as one immutable value, so a change is a single assignment.

Every operation computes a new :class:`SessionState` from the current one (tensors are
never written in place) and swaps it in at the end. An operation that raises has swapped
nothing: tokens, KV and revision stay bitwise as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
