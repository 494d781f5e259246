"""Why a server ran a different path than the one a directive asked for."""

from __future__ import annotations

from enum import StrEnum


class FallbackReason(StrEnum):
    """Named reasons for falling back to re-prefill. The client always learns which one."""

    invalid_edit = "invalid_edit"
    """The edited prompt is not the cached sequence with the directives applied."""
    token_mismatch = "token_mismatch"
    """The request's tokens diverge from the session's cached tokens where they should agree."""
    missing_source = "missing_source"
    """The session's cache is gone (evicted, restarted): nothing to splice from."""
    unsupported_runtime = "unsupported_runtime"
    """The engine cannot splice in its current configuration (e.g. hierarchical cache on)."""
    unsupported_rope = "unsupported_rope"
    """The model's RoPE cannot be shifted exactly (e.g. dynamic NTK)."""
    unsupported_layout = "unsupported_layout"
    """The model's cache layout is not one the engine knows how to rotate."""
    page_alignment = "page_alignment"
    """Part of the edit fell inside a partial page and was re-prefilled."""
