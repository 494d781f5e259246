"""The serving side: the reference torch engine (and, beside it, the HTTP server).

Follow one directive over HTTP: ``core.routes`` -> ``core.service.SessionService.apply``
(lease the session) -> ``core.batch.plan_batch`` (revision, resolve, limits, the protocol's
algebra, span remapping: every rule, once, for both backends) -> ``Backend.execute``:
here ``engine_backend.EngineBackend`` -> ``session.SessionCache.execute`` ->
``edit_paths.run_edits`` (splice or re-prefill) -> ``run_executor.execute_edit`` (runs ->
KV) -> ``rope.rotate_into`` (keys moved by delta). ``engine.Engine`` holds the model, its
RoPE and cache layout and the shared prefix cache; the SGLang plugin is the other backend.

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
