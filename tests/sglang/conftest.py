"""Tests of the SGLang plugin against SGLang 0.5.23's real cache classes (CPU).

Run them in the plugin's own environment (SGLang pins its own torch and transformers)::

    bash scripts/sglang/setup_env.sh
    .venv-sglang/bin/python -m pytest -p no:cacheprovider tests/sglang

Collected by an interpreter without sglang (the main venv), nothing here is collected.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
collect_ignore_glob = [] if HAS_SGLANG else ["test_*.py"]

_keep: list[Any] = []

if HAS_SGLANG:
    # PyPI's torchvision does not load beside CPU torch; sglang only needs it for
    # multimodal preprocessing. The stand-in lives on the test path, never in site-packages.
    sys.path.insert(0, str(Path(__file__).parent / "_stubs"))
    from sglang.srt.runtime_context import get_parallel

    # The pools read the parallel layout at construction: one rank, no DCP.
    _override = get_parallel().override(
        dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0, tp_size=1, tp_rank=0
    )
    _override.__enter__()
    _keep.append(_override)
