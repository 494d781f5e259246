"""What the core's tests share: the real SmolLM2 weights, loaded once."""

from __future__ import annotations

import pytest

from leyline.engine.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2")
