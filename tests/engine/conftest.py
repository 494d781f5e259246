"""Engine fixtures. The real SmolLM2 is loaded once per test session (slow + model tests)."""

from __future__ import annotations

import pytest

from leyline.engine.engine import Engine
from leyline.engine.models import LoadedModel, build_tiny_mla, load_model

from ._helpers import tiny_llama


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_engine(smollm2: LoadedModel) -> Engine:
    return Engine(smollm2)


@pytest.fixture(scope="session")
def llama_engine() -> Engine:
    return Engine(tiny_llama())


@pytest.fixture(scope="session", params=["v2", "v3"])
def mla_engine(request: pytest.FixtureRequest) -> Engine:
    return Engine(build_tiny_mla(request.param))
