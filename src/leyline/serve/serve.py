"""Build the app from settings: load the model, size the caches, wire the service."""

from __future__ import annotations

import torch
from fastapi import FastAPI

from leyline.engine.engine import Engine
from leyline.engine.kv.prefix_cache import PrefixCache
from leyline.engine.models import load_model
from leyline.protocol import Limits
from leyline.serve.app import create_app
from leyline.serve.settings import ServerSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_app(settings: ServerSettings, *, prefix_cache_bytes: int = 1024**3) -> FastAPI:
    if settings.dtype not in DTYPES:
        raise ValueError(f"dtype {settings.dtype!r}: expected one of {', '.join(DTYPES)}")
    loaded = load_model(settings.model, dtype=DTYPES[settings.dtype])
    cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
    # The registry enforces the session count (with LRU eviction), not the engine.
    limits = Limits(
        max_directives=settings.max_directives,
        max_replacement_tokens=settings.max_replacement_tokens,
        max_session_tokens=settings.max_session_tokens,
        max_sessions=None,
    )
    engine = Engine(loaded, prefix_cache=cache, limits=limits, prefill_chunk=settings.prefill_chunk)
    return create_app(engine, settings)
