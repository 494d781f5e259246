"""The live contract suite: one suite, run against each live backend over HTTP.

The driver runs in the main venv (reference engine, torch, transformers, the weights); the
server runs in its own venv. ``make sglang-live-check`` (a real SGLang 0.5.23 on CPU: SmolLM2
for GQA, a tiny DeepSeek-V2 for MLA) and ``make vllm-live-check`` (a real vLLM 0.32.0 on CPU,
SmolLM2) each start their servers, run this suite against each, and stop them. By hand::

    export LEYLINE_LIVE_ROTATION_OFF_FLAG=RUN_DIR/rotation-off   # server and tests alike
    export LEYLINE_LIVE_SHARED_SPLICE_FLAG=RUN_DIR/shared-splice
    bash scripts/sglang/live_server.sh start RUN_DIR MODEL_DIR PORT      # or scripts/vllm/
    LEYLINE_LIVE_BACKEND=sglang LEYLINE_LIVE_URL=http://127.0.0.1:PORT \\
        LEYLINE_LIVE_MODEL=MODEL_DIR .venv/bin/python -m pytest tests/live

``LEYLINE_LIVE_BACKEND`` names the server's kind (``sglang`` or ``vllm``: how plain requests
are sent, ``_plain.py``, and what the backend builds for an edit, ``_built.py``);
``LEYLINE_LIVE_MODEL`` is the directory the server was started on (the reference engine
loads the same weights). A test marked ``@pytest.mark.backends(...)`` checks what only those
backends offer (COMPOSE, SGLang's load reports) and is deselected on the others.
Without ``LEYLINE_LIVE_URL`` nothing here is collected: no server means no test, not a skip
that reads as a pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from ._plain import BACKEND, BACKENDS, page_size

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

URL = os.environ.get("LEYLINE_LIVE_URL", "")
collect_ignore_glob = [] if URL else ["test_*.py"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends(*names): live backends the test applies to (else deselected)"
    )
    if URL and BACKEND not in BACKENDS:
        raise pytest.UsageError(f"LEYLINE_LIVE_BACKEND must be one of {BACKENDS}, not {BACKEND!r}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("backends")
        (kept if marker is None or BACKEND in marker.args else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def url() -> str:
    return URL


@pytest.fixture(scope="session")
def server() -> Iterator[httpx.Client]:
    with httpx.Client(base_url=URL, timeout=600) as client:
        yield client


@pytest.fixture(scope="session")
def page(server: httpx.Client) -> int:
    """The granularity of the server's prefix cache (SGLang's page, vLLM's block)."""
    return page_size(server)


@pytest.fixture(scope="session")
def reference() -> Engine:
    """The reference engine on the same weights as the server (fp32)."""
    from leyline.engine.engine import Engine
    from leyline.engine.models import load_model

    model = os.environ.get("LEYLINE_LIVE_MODEL")
    if not model:
        pytest.fail("set LEYLINE_LIVE_MODEL to the model directory the server runs")
    return Engine(load_model(model))


@pytest.fixture(scope="session")
def report_path() -> Path | None:
    """Where measured figures go, one JSON line each (``LEYLINE_LIVE_REPORT``), if set."""
    path = os.environ.get("LEYLINE_LIVE_REPORT")
    return Path(path) if path else None
