"""A session's whole state as one immutable value, so a change is a single assignment.

Every operation computes a new :class:`SessionState` from the current one and swaps it in
at the end. An operation that raises has swapped nothing: tokens, KV and revision stay
bitwise as they were. Tensors are never written in place, with one exception: an edit of a
state that ``owns_kv`` may move its KV within its own buffers once nothing can fail any
more (``in_place_edit``), and the old state is then gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leyline.engine.forward import kv_length
from leyline.engine.kv.kv_blocks import KVCache
from leyline.protocol.spans import MessageSpan


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
    owns_kv: bool = False
    """The KV's buffers were allocated for this state and nothing else holds them (no fork,
    no other state): an edit may then run inside them (``in_place_edit``). False unless the
    operation that built the state says so."""

    @property
    def kv_length(self) -> int:
        return kv_length(self.kv)
