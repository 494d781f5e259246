"""The serving side: the reference torch engine (and, beside it, the HTTP server).

Follow one directive: ``engine.Engine`` (model, RoPE, cache layout, sessions) ->
``session.SessionCache.apply_directives`` (resolve with the protocol) -> ``apply_edits``
(the protocol's algebra) -> ``edit_executor.run_edits`` (splice or re-prefill) ->
``splice.execute_edit`` (runs -> KV) -> ``rope.rotate_into`` (keys moved by delta).

The heavy names are imported lazily, so ``import leyline.server_adapter.<light module>``
does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine
    from .models import LoadedModel, load_model
    from .session import SessionCache

__all__ = ["Engine", "LoadedModel", "SessionCache", "load_model"]

_LAZY = {
    "Engine": ".engine",
    "SessionCache": ".session",
    "LoadedModel": ".models",
    "load_model": ".models",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
