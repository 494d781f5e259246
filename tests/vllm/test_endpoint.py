"""The endpoint plugin's middleware on a stand-in vLLM app: the core's routes and
``leyline`` bodies go to the plugin, plain bodies to vLLM unchanged, reserved salts get a
422; and the runtime checks that make every edit refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
from fastapi import FastAPI

from leyline.protocol import FallbackReason, Limits
from leyline.protocol.resources import Routes
from leyline.vllm.backend import VllmBackend
from leyline.vllm.endpoint import LeylineEndpoint, mount, reserved_salt, runtime_refusal

from ._fake_engine import FakeEngine
from ._stand_in import call, stand_in_app


def _app() -> tuple[FastAPI, LeylineEndpoint]:
    return stand_in_app()


def _post(app: FastAPI, path: str, body: dict[str, Any]) -> httpx.Response:
    return call(app, "POST", path, body) if body else call(app, "GET", path)


def test_requests_are_routed_once_mounted() -> None:
    app, endpoint = _app()
    assert _post(app, Routes.capabilities, {}).status_code == 404  # not mounted yet: vLLM's
    backend = VllmBackend(FakeEngine(4), None, limits=Limits(), vocab_size=100, block_size=4)
    endpoint.mounted = mount(backend)
    caps = _post(app, Routes.capabilities, {})
    assert caps.status_code == 200 and "compose" in caps.json()["verbs"]
    skill = _post(app, Routes.skills, {"skill": "rules", "tokens": [1, 2, 3]})
    assert skill.status_code == 201 and skill.json()["num_tokens"] == 3, skill.text
    plain = {"prompt": [1, 2], "max_tokens": 1, "cache_salt": "mine"}
    assert _post(app, "/v1/completions", plain).json() == {"vllm": plain}
    reserved = _post(app, "/v1/completions", plain | {"cache_salt": "leyline-session-x"})
    assert reserved.status_code == 422 and reserved.json()["error"]["field"] == "cache_salt"
    turn = _post(app, "/v1/completions", plain | {"leyline": {}, "cache_salt": None})
    assert turn.status_code == 200 and "leyline" in turn.json(), turn.text
    assert "vllm" not in turn.json()


def test_reserved_salt_is_read_from_the_top_level_only() -> None:
    assert reserved_salt(b'{"cache_salt": "leyline-x"}')
    assert not reserved_salt(b'{"cache_salt": "mine", "note": "leyline-x"}')
    assert not reserved_salt(b'{"cache_salt": "leyline-x"')  # vLLM answers bad JSON


def test_runtime_refusal_names_what_is_missing() -> None:
    def config(connector: str | None, caching: bool = True) -> Any:
        transfer = None if connector is None else SimpleNamespace(kv_connector=connector)
        cache = SimpleNamespace(enable_prefix_caching=caching)
        return SimpleNamespace(kv_transfer_config=transfer, cache_config=cache)

    assert runtime_refusal(config("LeylineConnector")) is None
    for refused in (config(None), config("LMCacheConnectorV1"), config("LeylineConnector", False)):
        refusal = runtime_refusal(refused)
        assert refusal is not None and refusal.reason is FallbackReason.unsupported_runtime


def test_a_session_leaves_room_for_a_builds_filler_and_one_token() -> None:
    from leyline.vllm.build import padded
    from leyline.vllm.endpoint import session_cap

    for max_model_len, block in [(4096, 128), (2048, 128), (2000, 128), (100, 32)]:
        cap = session_cap(max_model_len, block)
        assert len(padded(range(cap), block)) + 1 <= max_model_len
        assert cap > max_model_len - 2 * block - 1
