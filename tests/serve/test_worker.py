"""``leyline serve`` as a router's worker: ``/server_info`` and ``/model_info`` (what
sglang-router 0.3.2 reads from a worker), open like ``/health``. An in-process app on the
random-weight tiny MLA model, with an API key."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from leyline.serve.settings import ServerSettings
from leyline.serve.worker import model_path

KEY = "worker-key-0123456789"
SERVED = "tiny-served"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from leyline.serve.serve import build_app

    settings = ServerSettings(
        model="tiny-mla-v3", api_key=KEY, served_model_name=SERVED, max_new_tokens=1
    )
    with TestClient(build_app(settings, prefix_cache_bytes=0)) as test_client:
        yield test_client


def test_server_info_and_model_info_need_no_key_and_name_the_model(client: TestClient) -> None:
    server = client.get("/server_info")  # no Authorization header
    assert server.status_code == 200, server.text
    assert server.json() == {
        "served_model_name": SERVED,
        "model_path": "tiny-mla-v3",  # not a path: the loaded model's own name
        "dp_size": 1,
        "version": version("leyline"),
    }
    model = client.get("/model_info")
    assert model.status_code == 200, model.text
    assert model.json() == {"model_path": "tiny-mla-v3", "is_generation": True}
    assert client.head("/server_info").status_code == 200


def test_the_rest_still_needs_the_key(client: TestClient) -> None:
    for path in ("/v1/models", "/leyline/v1/capabilities", "/get_server_info", "/metrics"):
        reply = client.get(path)
        assert reply.status_code == 401, (path, reply.text)
        assert reply.json()["error"]["code"] == "unauthorized"


def test_the_model_path_is_the_file_or_directory_served(tmp_path: Path) -> None:
    weights = tmp_path / "my-model"
    weights.mkdir()
    assert model_path(str(weights), "my-model") == str(weights.resolve())
    assert model_path("smollm2", "SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert model_path(str(tmp_path / "absent.gguf"), "x") == "x"
