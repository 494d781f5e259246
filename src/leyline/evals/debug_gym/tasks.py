"""mini_nightmare offline: load the completed task copy, build an environment per episode.

Imports debug_gym: call :func:`leyline.evals.debug_gym.sandbox.isolate` first.
``python -m leyline.evals.debug_gym.tasks`` loads all ten tasks and prints their starting
scores (the environment check of ``setup_env.sh``; it skips running the one task whose code
goes online).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm goes online

from debug_gym.gym.envs import MiniNightmareEnv
from debug_gym.gym.terminals.local import LocalTerminal
from debug_gym.gym.tools.toolbox import Toolbox
from debug_gym.logger import DebugGymLogger

TaskData = dict[str, Any]
"""debug-gym's task record: ``task_name``, ``codebase`` (a folder), ``filename``."""

DATA_ENV = "LEYLINE_MINI_NIGHTMARE"
# Variables of the harness's own process that must not reach the tasks' pytest runs.
_LEAKY_ENV = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_CURRENT_TEST", "PYTHONPATH")


def default_data_dir() -> Path:
    """``$LEYLINE_MINI_NIGHTMARE``, else ``<venv>/mini_nightmare`` (where setup_env.sh puts it)."""
    return Path(os.environ.get(DATA_ENV) or Path(sys.prefix) / "mini_nightmare")


def load_tasks(names: Sequence[str], data_dir: Path | None = None) -> dict[str, TaskData]:
    """The named tasks from the completed copy, without any download.

    Raises:
        FileNotFoundError: the copy is missing or incomplete (run setup_env.sh).
    """
    root = (data_dir or default_data_dir()).resolve()
    if not (root / "config" / "test.py").is_file():
        raise FileNotFoundError(
            f"no mini_nightmare copy at {root}: "
            f"run scripts/debug_gym/setup_env.sh or set {DATA_ENV}"
        )

    class OfflineMiniNightmare(MiniNightmareEnv):
        # load_dataset reads this class attribute; a subclass leaves debug-gym's intact.
        DATA_PATH = root

    dataset: dict[str, TaskData] = OfflineMiniNightmare.load_dataset(
        problems=list(names), build_image=False
    )
    return {name: dataset[name] for name in names}


def make_env(
    task: TaskData,
    tools: Sequence[str],
    logger: DebugGymLogger,
    run_timeout: int = 30,
) -> MiniNightmareEnv:
    """A fresh environment on the local terminal; reset() copies the task to a temp dir.

    The local terminal runs commands on this host (no sandbox): the task's ``python`` is
    this interpreter (it has pytest and pandas), and the working copy is a temp dir that
    debug-gym deletes on close.
    """
    terminal = LocalTerminal(logger=logger, command_timeout=max(60, 2 * run_timeout))
    for key in _LEAKY_ENV:
        terminal.env_vars.pop(key, None)
    bin_dir = str(Path(sys.executable).parent)
    terminal.env_vars["PATH"] = bin_dir + os.pathsep + terminal.env_vars.get("PATH", "")
    env = MiniNightmareEnv(
        task_data=task, terminal=terminal, logger=logger, run_timeout=run_timeout
    )
    for name in tools:
        env.add_tool(Toolbox.get_tool(name))
    return env


def _check(argv: Sequence[str]) -> int:
    """Load every task, reset it with the eval tool, print its starting score."""
    from .config import NETWORK_TASKS, TASK_NAMES
    from .gym_logger import quiet_logger

    names = list(argv) or list(TASK_NAMES)
    tasks = load_tasks(names)
    print(f"mini_nightmare: {len(tasks)} tasks from {default_data_dir()}")
    for name, task in tasks.items():
        if name in NETWORK_TASKS:  # the check stays offline
            print(f"  {name:<22} loaded, not run: {NETWORK_TASKS[name]}")
            continue
        env = make_env(task, ["eval"], quiet_logger())
        try:
            info = env.reset()
            print(f"  {name:<22} starting score {info.score}/{info.max_score}")
        finally:
            env.close()
    return 0


if __name__ == "__main__":
    sys.exit(_check(sys.argv[1:]))
