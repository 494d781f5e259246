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


@pytest.fixture(scope="session", params=["llama", "v2", "v3"])
def tiny_engine(request: pytest.FixtureRequest) -> Engine:
    """Each tiny random model: the GQA Llama of ``llama_engine`` and the MLA V2 and V3."""
    if request.param == "llama":
        return request.getfixturevalue("llama_engine")
    return Engine(build_tiny_mla(request.param))


@pytest.fixture(scope="module")
def mla() -> Engine:
    """A tiny MLA V2 engine of the module's own (its skill store and caches start empty)."""
    return Engine(build_tiny_mla("v2"))


# The COMPOSE tests run on the real model (slow) and both tiny MLA layouts.
COMPOSE_ENGINES = [
    pytest.param("smollm2", marks=[pytest.mark.slow, pytest.mark.model]),
    "tiny-mla-v2",
    "tiny-mla-v3",
]


@pytest.fixture(scope="module", params=COMPOSE_ENGINES)
def case(request: pytest.FixtureRequest) -> tuple[str, Engine]:
    """(name, engine) for each of ``COMPOSE_ENGINES``."""
    name = str(request.param)
    if name == "smollm2":
        return name, request.getfixturevalue("smollm2_engine")
    return name, Engine(build_tiny_mla("v2" if name == "tiny-mla-v2" else "v3"))
