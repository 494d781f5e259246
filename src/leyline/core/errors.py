"""Typed failures of the reference engine.

Protocol violations (bad spans, revision conflicts, unsupported verbs) are raised as the
protocol's ``LeylineError``. The two classes here cover what the protocol does not: a model
that is not on this machine, and a directive the engine cannot execute exactly for this
model (the caller falls back to re-prefill and reports ``reason``).
"""

from __future__ import annotations

from leyline.protocol.fallback import FallbackReason


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not available locally; the message says how to get it.

    The engine never downloads: no hub access at run time.
    """


class SpliceUnsupportedError(RuntimeError):
    """This model/runtime cannot execute a splice exactly; re-prefill instead.

    ``reason`` is the protocol's named fallback reason (e.g. ``unsupported_rope`` for
    dynamic-NTK RoPE, ``unsupported_layout`` for a cache layout the engine cannot rotate).
    """

    def __init__(self, reason: FallbackReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
