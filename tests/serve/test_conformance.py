"""Our own server passes the protocol's conformance suite, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from leyline.protocol.conformance import run_conformance

from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_leyline_serve_passes_every_conformance_check(server: Server) -> None:
    results = run_conformance(server.base_url, api_key=API_KEY)
    assert [r for r in results if not r.passed] == []
    assert len(results) >= 12


def test_conformance_command_reports_and_fails_without_the_key(server: Server) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "leyline.cli.main", "conformance", server.base_url],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert "FAIL" in done.stdout and "unauthorized" in done.stdout
