"""Tests of the debug-gym harness (``leyline.evals.debug_gym``).

Run them in the debug-gym venv (Python 3.12), from the repository root::

    bash scripts/debug_gym/setup_env.sh
    .venv-debuggym/bin/python -m pytest -p no:cacheprovider tests/evals_debug_gym

Collected by an interpreter without debug_gym (the main 3.11 venv), the module that
drives debug-gym is not collected at all (``make debug-gym-check`` runs it) and the pure
ones (statistics, report, config, server probe) still run.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import tests as _tests_package

ROOT = Path(__file__).resolve().parents[2]
HAS_DEBUG_GYM = importlib.util.find_spec("debug_gym") is not None
collect_ignore = [] if HAS_DEBUG_GYM else ["test_scripted_runs.py"]
NEEDS_DEBUG_GYM = (
    "needs debug_gym: bash scripts/debug_gym/setup_env.sh, then "
    ".venv-debuggym/bin/python -m pytest tests/evals_debug_gym"
)

# The debug-gym wheel installs a top-level `tests` package into site-packages; ours must be
# the one imported (pytest's rootdir insertion puts the repository first).
if Path(_tests_package.__file__).resolve().parent != ROOT / "tests":
    raise pytest.UsageError(
        f"`tests` resolves to {_tests_package.__file__}, not {ROOT / 'tests'}: run pytest "
        "from the repository root (rootdir with pyproject.toml)"
    )

_scratch = Path(tempfile.mkdtemp(prefix="leyline-test-home-"))
atexit.register(shutil.rmtree, _scratch, True)
os.environ.setdefault("MPLCONFIGDIR", str(_scratch / "matplotlib"))  # the report's plot

if HAS_DEBUG_GYM:
    from leyline.evals.debug_gym.sandbox import isolate

    # debug-gym writes ~/.config/debug_gym and ~/.cache/debug_gym when imported, and the
    # agents' shell commands inherit HOME: a throwaway HOME, set before any test imports it.
    isolate(_scratch)
