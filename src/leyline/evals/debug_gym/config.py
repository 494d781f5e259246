"""What one harness run is: the arms, the tasks, the endpoint, the budgets. No debug-gym here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from leyline.policies import parse_policy

ArmName = Literal["none", "reprefill", "splice"]
ARM_NAMES: tuple[ArmName, ...] = ("none", "reprefill", "splice")

TASK_NAMES = (
    "config",
    "counter",
    "grader",
    "pandas_dataframe",
    "patcher",
    "purr",
    "scientific_calculator",
    "shopping_cart",
    "sum_tree",
    "tomorrow_date",
)
"""The ten mini_nightmare tasks (debug-gym 1.3.0's ``MiniNightmareEnv.TASK_NAMES``)."""

NETWORK_TASKS = {
    "pandas_dataframe": "its code reads a CSV from gist.githubusercontent.com; offline it "
    "cannot pass under any arm",
}
"""Tasks whose own code goes to the internet when its tests run."""

DEFAULT_POLICY = "truncate:keep_last=2"
"""The paper's rule: drop tool outputs older than the last two tool turns."""

# debug-gym's configs/mini_nightmare.yaml: these tools, 50 steps, 30 s per test run.
DEFAULT_TOOLS = ("bash", "view", "pdb", "edit", "eval", "submit")
DEFAULT_MAX_STEPS = 50
DEFAULT_RUN_TIMEOUT = 30


@dataclass(frozen=True, slots=True)
class Arm:
    """One way of serving the agent's history.

    ``none`` sends the history as the agent built it; ``reprefill`` and ``splice`` run the
    same policy and differ only in how its edits reach the server: as edited messages (the
    server re-prefills from the first changed token) or as Leyline directives.
    """

    name: ArmName
    policy: str | None

    @property
    def splice(self) -> bool:
        return self.name == "splice"


def make_arms(names: Sequence[str], policy: str) -> tuple[Arm, ...]:
    """Arms in the given order; the two policy arms share ``policy``.

    Raises:
        ValueError: an unknown or repeated arm name, or a policy that does not parse.
    """
    parse_policy(policy)  # fail before any episode runs
    arms: list[Arm] = []
    for name in names:
        if name not in ARM_NAMES:
            raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARM_NAMES)}")
        if any(a.name == name for a in arms):
            raise ValueError(f"arm {name!r} given twice")
        arms.append(Arm(name, None if name == "none" else policy))
    if not arms:
        raise ValueError("no arms given")
    return tuple(arms)


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything an evaluation run needs; ``model=None`` asks the server (``/v1/models``)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    api_key: str = "EMPTY"
    tasks: tuple[str, ...] = TASK_NAMES
    runs: int = 3
    arms: tuple[Arm, ...] = field(default_factory=lambda: make_arms(ARM_NAMES, DEFAULT_POLICY))
    max_steps: int = DEFAULT_MAX_STEPS
    tools: tuple[str, ...] = DEFAULT_TOOLS
    out: Path = Path("results/debug_gym")
    data_dir: Path | None = None
    """The completed mini_nightmare copy (None: ``$LEYLINE_MINI_NIGHTMARE`` or the venv's)."""
    temperature: float | None = None
    max_tokens: int | None = 1024
    context_limit_k: int = 128
    """debug-gym trims prompts above this many thousand tokens (its own count)."""
    run_timeout: int = DEFAULT_RUN_TIMEOUT
    max_retries: int = 3
    jobs: int = 1
    scripted: bool = False
    """Drive the agent with the scripted stand-in (no server, no model): a wiring check."""
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tasks) - set(TASK_NAMES))
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; choose from {', '.join(TASK_NAMES)}")
        if not self.tasks:
            raise ValueError("no tasks given")
        for name in ("runs", "max_steps", "jobs", "context_limit_k", "run_timeout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if "listdir" in self.tools:
            # listdir runs `apt-get update && apt-get install -y tree` at every reset.
            raise ValueError("the listdir tool installs packages on the host at reset; use bash")
