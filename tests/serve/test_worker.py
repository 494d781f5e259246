"""``leyline serve`` as a router's worker: ``/server_info`` and ``/model_info`` (what
sglang-router 0.3.2 reads from a worker), open like ``/health``, and ``--worker-name``'s
``X-Leyline-Worker`` header on every response. An in-process app on the random-weight tiny
MLA model, with an API key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from leyline.serve.settings import ServerSettings
from leyline.serve.worker import model_path

KEY = "worker-key-0123456789"
SERVED = "tiny-served"
WORKER = "worker-a:31001"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from leyline.serve.serve import build_app

    settings = ServerSettings(
        model="tiny-mla-v3",
        api_key=KEY,
        served_model_name=SERVED,
        max_new_tokens=2,
        max_body_bytes=100_000,
        worker_name=WORKER,
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


def test_every_response_names_the_worker(client: TestClient) -> None:
    answers = {
        "health": client.get("/health"),
        "server_info": client.get("/server_info"),
        "head": client.head("/model_info"),
        "no key (401)": client.get("/leyline/v1/capabilities"),
        "unknown route (404)": client.get("/nowhere", headers=AUTH),
        "wrong method (405)": client.put("/v1/completions", headers=AUTH),
        "bad body (422)": client.post("/v1/completions", headers=AUTH, content=b"{"),
        "too big (413)": client.post("/v1/completions", headers=AUTH, content=b"[" * 200_000),
        "unknown session (404)": client.get("/leyline/v1/sessions/none", headers=AUTH),
    }
    body = {"prompt": [5, 17, 29, 41], "max_tokens": 2, "leyline": {"session": "w"}}
    answers["completion"] = client.post("/v1/completions", json=body, headers=AUTH)
    assert answers["completion"].status_code == 200, answers["completion"].text
    statuses = {name: reply.status_code for name, reply in answers.items()}
    assert statuses["too big (413)"] == 413 and statuses["wrong method (405)"] == 405, statuses
    for name, reply in answers.items():
        assert reply.headers.get_list("x-leyline-worker") == [WORKER], name


def test_a_streamed_response_names_the_worker(client: TestClient) -> None:
    body = {"prompt": [5, 17, 29, 41], "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers.get_list("x-leyline-worker") == [WORKER]
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"  # the stream itself passes through whole
    assert json.loads(events[0].removeprefix("data: "))["object"] == "text_completion"


def test_the_flag_reaches_the_server_and_without_it_there_is_no_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uvicorn

    from leyline.cli.main import main

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    flags = ["--model", "tiny-mla-v3", "--prefix-cache-gib", "0", "--release-freed-memory"]
    assert main(["serve", *flags, "--worker-name", "w7"]) == 0
    assert main(["serve", *flags]) == 0
    headers = []
    for app in served:
        with TestClient(app) as test_client:  # its lifespan stops the app's scheduler
            headers.append(test_client.get("/health").headers)
    assert headers[0]["x-leyline-worker"] == "w7"
    assert "x-leyline-worker" not in headers[1]


@pytest.mark.parametrize("name", ["", "two words", "a\r\nSet-Cookie: x=1", "é", "w" * 129])
def test_a_name_that_is_not_a_plain_header_value_is_refused(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="worker_name"):
        ServerSettings(worker_name=name)
    from leyline.cli.main import main

    flags = ["--model", "tiny-mla-v3", "--release-freed-memory"]
    assert main(["serve", *flags, "--worker-name", name]) == 2
    assert "worker_name must be" in capsys.readouterr().err


def test_a_plugin_reads_its_worker_name_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from leyline.serve.worker import WORKER_NAME_ENV, worker_name_from_env

    monkeypatch.delenv(WORKER_NAME_ENV, raising=False)
    assert worker_name_from_env() is None
    monkeypatch.setenv(WORKER_NAME_ENV, "")
    assert worker_name_from_env() is None
    monkeypatch.setenv(WORKER_NAME_ENV, "sglang-B")
    assert worker_name_from_env() == "sglang-B"
    monkeypatch.setenv(WORKER_NAME_ENV, "two words")
    with pytest.raises(ValueError, match=WORKER_NAME_ENV):
        worker_name_from_env()
