"""The CPU-speed wing's one switch, ``LEYLINE_CPU_KERNELS``, and an in-process override.

Unset (or ``1``/``auto``), every piece runs where it applies; ``0`` turns the whole wing off
(plain torch: no compiled kernels, no packed weights, transformers' own layer forward).
Benchmarks and tests that compare one piece on and off use :func:`override` instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

ENV = "LEYLINE_CPU_KERNELS"
PIECES = (
    "attention_kernel",
    "rope_kernel",
    "linear_kernel",
    "layer_kernel",
    "packed_linear",
    "lean_layers",
    "fused_forward",
)
"""What the switch covers: the four compiled kernels, then the packed weights, the lean
decoder layers and the fused forward loop."""
Setting = Literal["auto", "on", "off"]
"""``auto``: where it applies (the default); ``on``: also where it would not by default
(``packed_linear`` off AVX-512); ``off``: never."""

_OFF = ("0", "off", "false", "no")
_AUTO = ("", "1", "on", "auto", "true", "yes")
OVERRIDES: dict[str, Setting] = {}
"""What :func:`override` has forced, by piece (tests may ``monkeypatch.setitem`` it)."""
_warned_values: set[str] = set()
log = logging.getLogger("leyline.engine.cpu")


def wing_off() -> bool:
    """Whether ``LEYLINE_CPU_KERNELS`` turns the wing off (an unknown value warns once and
    counts as unset)."""
    value = os.environ.get(ENV)
    if value is None:
        return False
    value = value.strip().lower()
    if value in _OFF:
        return True
    if value not in _AUTO and value not in _warned_values:
        _warned_values.add(value)
        log.warning("%s=%r is not 0 or 1: the CPU kernels stay on (auto)", ENV, value)
    return False


def setting(piece: str) -> Setting:
    """The setting in force for ``piece`` (one of :data:`PIECES`): an override, else
    ``off`` where the environment turns the wing off, else ``auto``."""
    if piece not in PIECES:
        raise KeyError(f"no CPU-wing piece {piece!r} (one of {', '.join(PIECES)})")
    forced = OVERRIDES.get(piece)
    if forced is not None:
        return forced
    return "off" if wing_off() else "auto"


def refusal(piece: str) -> str:
    """Why ``piece`` is switched off; empty where it may run."""
    if setting(piece) != "off":
        return ""
    return f"{piece} switched off in process" if piece in OVERRIDES else f"{ENV}=0"


@contextmanager
def override(**settings: Setting) -> Iterator[None]:
    """Force pieces on or off inside the block, e.g. ``override(fused_forward="off")``
    (A/B runs, tests); an override wins over the environment."""
    for piece, value in settings.items():
        setting(piece)  # names a piece
        if value not in ("auto", "on", "off"):
            raise ValueError(f"{piece}: a setting is auto, on or off, not {value!r}")
    saved = {piece: OVERRIDES.get(piece) for piece in settings}
    OVERRIDES.update(settings)
    try:
        yield
    finally:
        for piece, was in saved.items():
            if was is None:
                OVERRIDES.pop(piece, None)
            else:
                OVERRIDES[piece] = was
