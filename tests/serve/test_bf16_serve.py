"""``leyline serve --dtype bfloat16``: weights and cache in bf16, splices still exact in
their own arithmetic (the same splice in-process on a bf16 engine gives the same logprobs)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from leyline.core.turns import SamplingParams
from leyline.engine.engine import Engine
from leyline.engine.session import SessionCache

from .conftest import Server, serve
from .conversation import TOOLS, turn1
from .test_sessions import STUB, _directive, _spans

pytestmark = [pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("bf16") / "serve.log"
    with serve(log, "--dtype", "bfloat16", "--log-level", "warning") as running:
        yield running


def test_a_bf16_server_splices_like_a_bf16_engine(bf16_server: Server) -> None:
    messages = turn1()
    body = {"model": "m", "messages": messages, "max_tokens": 2, "temperature": 0}
    render = {"tools": TOOLS, "add_generation_prompt": True}
    with bf16_server.client() as http:
        first_prompt = http.post(
            "/leyline/v1/tokenize", json={"messages": messages, **render}
        ).json()["tokens"]
        first = http.post(
            "/v1/chat/completions", json=body | {"tools": TOOLS, "leyline": {"session": "b"}}
        )
        assert first.status_code == 200, first.text
        before = http.get("/leyline/v1/sessions/b", params={"tokens": "true"}).json()
        directive = {
            "verb": "splice",
            "span": {"message": 3, "part": "content"},
            "replacement": STUB,
        }
        messages[3] = {**messages[3], "content": STUB}
        leyline = {"session": "b", "base_revision": before["revision"], "directives": [directive]}
        extra = {"logprobs": True, "top_logprobs": 5, "max_tokens": 1, "tools": TOOLS}
        third = http.post("/v1/chat/completions", json=body | extra | {"leyline": leyline}).json()
        prompt = http.post("/leyline/v1/tokenize", json={"messages": messages, **render}).json()[
            "tokens"
        ]
    assert third["leyline"]["path"] == "splice" and third["leyline"]["rotated_tokens"] > 0

    # The same operations in the same order on a bf16 engine: the prompt prefilled, two
    # greedy tokens decoded one by one, the splice, the edited prompt. bf16 rounds logits by
    # up to 0.06 at |logit| 16-32, so a history computed differently (one prefill of the
    # generated tokens instead of two decode steps) would differ by more than any splice bug.
    # bf16 products also round differently with the number of threads that split them, and
    # other tests of this process may have changed it: use the server's (a fresh process's).
    threads = torch.get_num_threads()
    torch.set_num_threads(_fresh_process_threads())
    try:
        engine = Engine.load("smollm2", dtype=torch.bfloat16)
        session = SessionCache(engine)
        session.prefill(first_prompt, spans=_spans(before["spans"]))
        session.generate(SamplingParams(max_new_tokens=2))
        assert list(session.tokens) == before["tokens"]
        session.apply_directives([_directive(directive)], base_revision=session.revision)
        session.prefill(prompt)
        expected = torch.log_softmax(session.next_token_logits(), dim=-1)
    finally:
        torch.set_num_threads(threads)
    top = third["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    checked = 0
    for entry in top:
        token = engine.encode(entry["token"])
        if len(token) == 1:
            assert math.isclose(entry["logprob"], float(expected[token[0]]), abs_tol=2e-2)
            checked += 1
    assert checked >= 3


def _fresh_process_threads() -> int:
    probe = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    return int(out.stdout)


def test_an_unknown_dtype_is_refused_with_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "leyline.cli.main", "serve", "--dtype", "float8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--dtype" in out.stderr and "bfloat16" in out.stderr
