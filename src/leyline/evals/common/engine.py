"""The reference engine of the in-process evals that move text's KV (compose, memory)."""

from __future__ import annotations

import time
from typing import Any

import torch

from leyline.engine.engine import Engine
from leyline.engine.models import load_model


def rotating_engine(model: str, texts: str) -> Engine:
    """``model`` on the reference engine; it must rotate keys and have a tokenizer (the
    eval's ``texts``, e.g. "skills", are text)."""
    engine = Engine(load_model(model))
    if engine.layout is None or engine.rope is None:
        raise RuntimeError(
            f"{engine.loaded.label}: keys cannot be rotated ({engine.splice_refusal})"
        )
    if engine.tokenizer is None:
        raise RuntimeError(f"{engine.loaded.label} has no tokenizer; the {texts} are text")
    return engine


def run_footer(seed: int, fast: bool, started: float) -> dict[str, Any]:
    """The last entries of such an eval's configuration: seed, mode, torch threads, and the
    seconds since ``started`` (a ``time.perf_counter()``)."""
    return {
        "seed": seed,
        "fast": fast,
        "torch_threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - started, 1),
    }
