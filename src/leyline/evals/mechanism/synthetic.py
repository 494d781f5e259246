"""Seeded synthetic debugging trajectories with realistic tool outputs.

A made-up Python project (modules, classes, functions) and the outputs an agent sees while
debugging it: pytest runs with tracebacks, numbered file views, grep hits, listings and
diffs. Lengths vary like real ones (tens to several hundred tokens), so a truncation policy
has real work to do and the splice arm real spans to cut.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from leyline.evals.common.messages import ToolTurn

from .trajectories import DEBUG_GYM_SYSTEM, Trajectory

NOUNS = (
    "cart",
    "invoice",
    "ledger",
    "order",
    "price",
    "stock",
    "account",
    "session",
    "report",
    "parser",
    "token",
    "schedule",
    "route",
    "queue",
    "cache",
    "record",
    "shipment",
    "payment",
)
VERBS = ("compute", "apply", "load", "parse", "update", "validate", "merge", "render", "total")
ERRORS = (
    ("AssertionError", "assert {a} == {b}"),
    ("KeyError", "'{noun}_id'"),
    ("TypeError", "unsupported operand type(s) for +: 'int' and 'NoneType'"),
    ("ZeroDivisionError", "division by zero"),
    ("IndexError", "list index out of range"),
    ("ValueError", "invalid literal for int() with base 10: '{a}x'"),
)


@dataclass(frozen=True, slots=True)
class Project:
    name: str
    modules: tuple[str, ...]
    functions: dict[str, tuple[str, ...]]


def _project(rng: random.Random) -> Project:
    nouns = rng.sample(NOUNS, 5)
    modules = tuple(f"{n}_utils.py" if i % 2 else f"{n}.py" for i, n in enumerate(nouns))
    functions = {
        m: tuple(f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}" for _ in range(rng.randint(3, 6)))
        for m in modules
    }
    return Project(name=f"{nouns[0]}_service", modules=modules, functions=functions)


def _code_line(rng: random.Random, indent: int) -> str:
    a, b = rng.choice(NOUNS), rng.choice(NOUNS)
    forms = (
        f"{a} = {b}.get('{rng.choice(NOUNS)}', 0)",
        f"if {a} is None:\n{' ' * (indent + 4)}return {rng.randint(0, 9)}",
        f"total += {a}.amount * (1 - {b}.rate / 100)",
        f"for {a} in self.{b}s:",
        f"{a}s = [x for x in {b}s if x.active]",
        f"return round({a} * {rng.randint(2, 12)} / {b}, 2)",
        f"self.{a} = {b}",
        f"log.debug('{a}=%s {b}=%s', {a}, {b})",
    )
    return " " * indent + rng.choice(forms)


def _function(rng: random.Random, name: str) -> list[str]:
    args = ", ".join(rng.sample(NOUNS, rng.randint(1, 3)))
    body = [_code_line(rng, 8) for _ in range(rng.randint(3, 9))]
    return [f"    def {name}(self, {args}):", f'        """{name.replace("_", " ")}."""', *body, ""]


def _file_view(rng: random.Random, project: Project, module: str) -> str:
    cls = module.removesuffix(".py").title().replace("_", "")
    lines = ["import logging", "", "log = logging.getLogger(__name__)", "", f"class {cls}:"]
    for fn in project.functions[module]:
        lines += _function(rng, fn)
    body = "\n".join(f"{i:>6} {line}" for i, line in enumerate("\n".join(lines).split("\n"), 1))
    total = body.count("\n") + 1
    return f"Viewing `{module}`, lines 1-{total} of {total} total lines.\n\n```\n{body}\n```"


def _pytest(rng: random.Random, project: Project, failing: int) -> str:
    tests = [f"tests/test_{m}" for m in project.modules]
    counts = [rng.randint(3, 9) for _ in tests]
    lines = [
        "=" * 29 + " test session starts " + "=" * 30,
        "platform linux -- Python 3.12.1, pytest-8.3.4, pluggy-1.5.0",
        f"rootdir: /workspace/{project.name}",
        f"collected {sum(counts)} items",
        "",
    ]
    failed: list[tuple[str, str, str]] = []
    for test, n in zip(tests, counts, strict=True):
        marks = ["." for _ in range(n)]
        if len(failed) < failing and rng.random() < 0.7:
            k = rng.randrange(n)
            marks[k] = "F"
            fn = rng.choice(project.functions[test.removeprefix("tests/test_")])
            failed.append((test, f"test_{fn}", fn))
        lines.append(f"{test} {''.join(marks)}")
    lines += ["", "=" * 35 + " FAILURES " + "=" * 35]
    for test, name, fn in failed:
        kind, template = rng.choice(ERRORS)
        message = template.format(a=rng.randint(10, 999), b=rng.randint(10, 999), noun=fn)
        module = test.removeprefix("tests/test_")
        lines += [
            "_" * 20 + f" {name} " + "_" * 20,
            "",
            f"    def {name}():",
            f"        obj = make_{fn.split('_')[-1]}()",
            f">       result = obj.{fn}({rng.randint(1, 50)})",
            "",
            f"{test}:{rng.randint(10, 80)}: ",
            "_ " * 20,
            f"{module}:{rng.randint(10, 60)}: in {fn}",
            _code_line(rng, 4),
            f"E   {kind}: {message}",
            "",
        ]
    summary = [f"FAILED {t}::{n}" for t, n, _ in failed]
    passed = sum(counts) - len(failed)
    lines += ["=" * 24 + " short test summary info " + "=" * 24, *summary]
    lines.append(f"{'=' * 20} {len(failed)} failed, {passed} passed in {rng.uniform(0.2, 4):.2f}s")
    return "\n".join(lines)


def _grep(rng: random.Random, project: Project, pattern: str) -> str:
    hits = []
    for module in rng.sample(project.modules, 3):
        for _ in range(rng.randint(1, 5)):
            hits.append(f"{module}:{rng.randint(5, 120)}:{_code_line(rng, 8)} # {pattern}")
    return "\n".join(hits)


def _listing(rng: random.Random, project: Project) -> str:
    rows = ["total 64", "drwxr-xr-x 4 agent agent 4096 Nov 29 10:02 ."]
    for name in (*project.modules, "README.md", "setup.cfg", "tests"):
        size = rng.randint(300, 9000)
        rows.append(f"-rw-r--r-- 1 agent agent {size:>5} Nov 29 10:0{rng.randint(0, 9)} {name}")
    return "\n".join(rows)


def _diff(rng: random.Random, module: str) -> str:
    start = rng.randint(5, 60)
    return "\n".join(
        [
            f"The file `{module}` has been updated successfully.",
            "",
            "Diff:",
            "--- original",
            "+++ current",
            f"@@ -{start},4 +{start},4 @@",
            _code_line(rng, 8),
            "-" + _code_line(rng, 7),
            "+" + _code_line(rng, 7),
            _code_line(rng, 8),
        ]
    )


def synthetic_trajectory(index: int, *, seed: int, turns: int = 10) -> Trajectory:
    rng = random.Random(seed * 7919 + index)
    project = _project(rng)
    calls: list[ToolTurn] = [ToolTurn("bash", {"command": "ls -la"}, _listing(rng, project))]
    calls.append(ToolTurn("eval", {}, _pytest(rng, project, failing=rng.randint(1, 3))))
    while len(calls) < turns:
        module = rng.choice(project.modules)
        kind = rng.random()
        if kind < 0.45:
            calls.append(ToolTurn("view", {"path": module}, _file_view(rng, project, module)))
        elif kind < 0.65:
            fn = rng.choice(project.functions[module])
            calls.append(
                ToolTurn("bash", {"command": f"grep -n {fn} *.py"}, _grep(rng, project, fn))
            )
        elif kind < 0.8:
            calls.append(ToolTurn("edit", {"path": module}, _diff(rng, module)))
        else:
            output = _pytest(rng, project, failing=rng.randint(0, 2))
            calls.append(ToolTurn("eval", {}, output))
    task = (
        f"The test suite of `{project.name}` fails. Find the bug, fix it, and make every test pass."
    )
    return Trajectory(
        f"synthetic/{index}", "synthetic", DEBUG_GYM_SYSTEM, task, tuple(calls[:turns])
    )


def synthetic_trajectories(count: int, *, seed: int, turns: int = 10) -> list[Trajectory]:
    return [synthetic_trajectory(i, seed=seed, turns=turns) for i in range(count)]
