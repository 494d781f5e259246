"""What the server built for an edit, computed by the reference engine: the edit's
definition (the reference engine's splice, forget or batch) whenever the server reports no
fallback, and else what the fallback it reports means on that backend.

The one fallback modelled: vLLM re-prefills a batch holding a splice before a FORGET from
its first change (docs/vllm-design.md) and reports ``unsupported_runtime``: the result is
the exact prefill of the edited tokens. Any other fallback has no model here and fails the
test that meets it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from leyline.protocol.algebra import Edit, apply_edits
from leyline.protocol.directives import Mode

from ._plain import BACKEND

if TYPE_CHECKING:
    from leyline.engine.engine import Engine
    from leyline.engine.session import SessionCache


def built_session(
    engine: Engine, old: Sequence[int], edits: Sequence[Edit], fallback: str | None = None
) -> SessionCache:
    """The reference engine's session holding what the live backend built when ``edits``
    (one batch, old coordinates, in order) applied to a session holding ``old`` and the
    server reported ``fallback``."""
    from leyline.engine.session import SessionCache

    session = SessionCache(engine)  # standalone: no prefix cache, nothing shared
    if fallback is None:  # the definition
        session.prefill(old)
        if edits:
            session.apply_edits(edits)
        return session
    forgets = any(edit.mode is Mode.forget for edit in edits)
    assert (BACKEND, fallback, forgets) == ("vllm", "unsupported_runtime", True), (
        f"no model of a {fallback} fallback on {BACKEND} for these edits: {edits}"
    )
    session.prefill(apply_edits(tuple(old), list(edits)).tokens)  # re-prefilled: exact
    return session
