"""The reference torch engine: one model, its RoPE and cache layout, sessions and their KV.

``engine.Engine`` owns the model and the shared prefix cache; ``session.SessionCache`` is one
agent's cached sequence, edited by the plans the session core makes (``backend.EngineBackend``
is the core's view of it). How edits run on KV is in ``edits/``, KV storage in ``kv/``, the
optional CPU kernels in ``cpu/``. The heavy names below import lazily, so importing a light
module of this package does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leyline.engine.engine import Engine
    from leyline.engine.models import LoadedModel, load_model
    from leyline.engine.session import SessionCache

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
