"""Live tests of the SGLang plugin: a real SGLang 0.5.23 server on CPU, driven over HTTP.

The driver runs in the main venv (reference engine, torch, transformers, the weights); the
server runs in .venv-sglang. ``make sglang-live-check`` starts one server per model (SmolLM2
for GQA, a tiny DeepSeek-V2 for MLA), runs these tests against each, and stops it. By hand::

    export LEYLINE_LIVE_ROTATION_OFF_FLAG=RUN_DIR/rotation-off   # server and tests alike
    export LEYLINE_LIVE_SHARED_SPLICE_FLAG=RUN_DIR/shared-splice
    bash scripts/sglang/live_server.sh start RUN_DIR MODEL_DIR PORT
    LEYLINE_SGLANG_URL=http://127.0.0.1:PORT LEYLINE_SGLANG_MODEL=MODEL_DIR \\
        .venv/bin/python -m pytest tests/sglang_live

``LEYLINE_SGLANG_MODEL`` is the directory the server was started on (the reference engine
loads the same weights). Without ``LEYLINE_SGLANG_URL`` nothing here is collected: no server
means no test, not a skip that reads as a pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

URL = os.environ.get("LEYLINE_SGLANG_URL", "")
collect_ignore_glob = [] if URL else ["test_*.py"]


@pytest.fixture(scope="session")
def server() -> Iterator[httpx.Client]:
    with httpx.Client(base_url=URL, timeout=600) as client:
        yield client


@pytest.fixture(scope="session")
def reference() -> Engine:
    """The reference engine on the same weights as the server (fp32)."""
    from leyline.engine.engine import Engine
    from leyline.engine.models import load_model

    model = os.environ.get("LEYLINE_SGLANG_MODEL")
    if not model:
        pytest.fail("set LEYLINE_SGLANG_MODEL to the model directory the server runs")
    return Engine(load_model(model))


@pytest.fixture(scope="session")
def report_path() -> Path | None:
    """Where measured figures go, one JSON line each (``LEYLINE_SGLANG_REPORT``), if set."""
    path = os.environ.get("LEYLINE_SGLANG_REPORT")
    return Path(path) if path else None
