"""The ``leyline`` command line as a user runs it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from leyline.protocol.schema import build_schema
from tests.policies.loopback import Loopback, QuietHandler, serving


def leyline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "leyline.cli.main", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_schema_command_prints_the_schema() -> None:
    done = leyline("schema")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == build_schema()


def test_schema_check_passes_on_a_fresh_tree() -> None:
    done = leyline("schema", "--check")
    assert done.returncode == 0, done.stderr


def test_help_names_every_command_and_unknown_ones_fail() -> None:
    assert "schema" in leyline("--help").stdout
    bad = leyline("splice-everything")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


@pytest.fixture()
def plain_http_server() -> Iterator[str]:
    """A local HTTP server that is not Leyline: it answers 404 to everything."""
    server = Loopback(_NotFound)
    with serving(server):
        yield server.root


class _NotFound(QuietHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    do_POST = do_DELETE = do_GET


def test_conformance_against_a_server_that_is_not_leyline(plain_http_server: str) -> None:
    done = leyline("conformance", plain_http_server)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not a Leyline server" in done.stdout and "HTTP 404" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert "0 passed, 1 failed" in done.stdout


def test_conformance_against_nothing_says_it_cannot_connect() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = leyline("conformance", f"http://127.0.0.1:{port}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cannot connect" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_serve_without_the_server_extras_says_what_to_install() -> None:
    # An SDK-only install: the server stack cannot be imported.
    code = (
        "import sys; sys.modules.update(fastapi=None, uvicorn=None); "
        "from leyline.cli.main import main; sys.exit(main(['serve']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "pip install 'leyline[server]'" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("options", "retained"), [((), True), (("--release-freed-memory",), False)]
)
def test_serve_keeps_freed_memory_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, options: tuple[str, ...], retained: bool
) -> None:
    """The server opts in to ``allocator.retain_freed_memory`` before loading the model, so
    its splices and generations reuse mapped KV buffers; ``--release-freed-memory`` opts out."""
    pytest.importorskip("fastapi")
    from leyline.cli.main import main
    from leyline.engine.kv import allocator
    from leyline.serve import serve

    calls: list[str] = []

    def retain() -> bool:
        calls.append("retain")
        return True

    def build_app(*args: object, **kwargs: object) -> None:
        calls.append("build_app")
        raise ValueError("stopped before loading a model")

    monkeypatch.setattr(allocator, "retain_freed_memory", retain)
    monkeypatch.setattr(serve, "build_app", build_app)
    assert main(["serve", *options]) == 2
    assert calls == (["retain", "build_app"] if retained else ["build_app"])
