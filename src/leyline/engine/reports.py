"""What a generation reports back: the turn types live in the core, shared by every backend."""

from __future__ import annotations

from leyline.core.report import OpReport
from leyline.core.turns import GenerationResult, TokenChoice

__all__ = ["GenerationResult", "OpReport", "TokenChoice"]
