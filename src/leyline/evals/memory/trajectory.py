"""A seeded agent trajectory that has nothing to do with the user: a coding agent's tool
calls and their outputs (listings, test failures, grep hits, code, logs, commits).

It is the distance between an early profile and the question: the trajectory is drawn per
item and cut at whole steps to a token budget, so the same seed and budget give the same
turns and a longer budget extends a shorter one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence

Encode = Callable[[str], Sequence[int]]


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    "parser scheduler ledger router buffer shard index queue encoder decoder batch "
    "manifest checkpoint registry snapshot planner bucket cursor segment journal"
)
_VERBS = _words(
    "parse flush merge retry encode decode split rotate resolve compact load store "
    "render validate emit drain"
)
_TASKS = (
    "The nightly job fails on the {n} module. Find out why and fix it.",
    "Tests in tests/test_{n}.py started failing after the last merge. Please investigate.",
    "The {n} is slow on large inputs; profile it and propose a fix.",
    "Clean up the {n} code path: there is a crash when the input is empty.",
)
_THOUGHTS = (
    "Let me look at the failing test first.",
    "The traceback points at the {n}; I will read that function.",
    "I want to see where {v}_{n} is called from.",
    "Checking the recent history of this file.",
    "The log should show when it started.",
    "Let me run the suite again to see if the change helped.",
    "I will list the package to find the right module.",
    "That value looks off by one; reading the loop.",
)


def _name(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_NOUNS), rng.choice(_VERBS)


def _ls(rng: random.Random) -> tuple[str, str]:
    pkg = rng.choice(_NOUNS)
    rows = [
        f"-rw-r--r--  1 dev dev {rng.randrange(200, 40000):>6} Mar {rng.randrange(1, 29):>2} "
        f"{rng.randrange(0, 24):02d}:{rng.randrange(0, 60):02d} {n}.py"
        for n in rng.sample(_NOUNS, 6)
    ]
    return f"ls -la src/app/{pkg}", "total 96\n" + "\n".join(rows)


def _pytest(rng: random.Random) -> tuple[str, str]:
    n, v = _name(rng)
    line, got, want = rng.randrange(20, 400), rng.randrange(0, 999), rng.randrange(0, 999)
    out = (
        f"============ test session starts ============\ncollected {rng.randrange(8, 90)} items\n\n"
        f"tests/test_{n}.py ..F\n\n================= FAILURES =================\n"
        f"____________ test_{v}_{n}_roundtrip ____________\n\n"
        f"    def test_{v}_{n}_roundtrip():\n        data = make_{n}(size={rng.randrange(2, 64)})\n"
        f">       assert {v}(data).count == {want}\nE       assert {got} == {want}\n\n"
        f"src/app/{n}.py:{line}: AssertionError\n"
        f"========= 1 failed, {rng.randrange(2, 80)} passed in {rng.uniform(0.3, 9):.2f}s ========="
    )
    return f"pytest -x tests/test_{n}.py", out


def _grep(rng: random.Random) -> tuple[str, str]:
    n, v = _name(rng)
    rows = [
        f"src/app/{rng.choice(_NOUNS)}.py:{rng.randrange(5, 600)}:    "
        f"{rng.choice(['result = ', 'return ', 'self.', ''])}{v}_{n}({rng.choice(_NOUNS)})"
        for _ in range(rng.randrange(3, 7))
    ]
    return f'grep -rn "{v}_{n}" src/', "\n".join(rows)


def _code(rng: random.Random) -> tuple[str, str]:
    n, v = _name(rng)
    start = rng.randrange(10, 300)
    body = [
        f"def {v}_{n}(items, limit={rng.randrange(2, 128)}):",
        f'    """{v.capitalize()} the {n} entries up to limit."""',
        "    out = []",
        "    for i, item in enumerate(items):",
        "        if i >= limit:",
        "            break",
        f"        out.append(item.{rng.choice(_VERBS)}())",
        f"    return {rng.choice(_NOUNS)}_from(out)",
    ]
    lines = "\n".join(f"{start + i:>4}  {text}" for i, text in enumerate(body))
    return f"sed -n {start},{start + len(body) - 1}p src/app/{n}.py", lines


def _log(rng: random.Random) -> tuple[str, str]:
    rows = []
    for _ in range(rng.randrange(4, 8)):
        n, v = _name(rng)
        level = rng.choice(["INFO", "INFO", "WARN", "ERROR", "DEBUG"])
        rows.append(
            f"2024-03-{rng.randrange(1, 29):02d} {rng.randrange(0, 24):02d}:"
            f"{rng.randrange(0, 60):02d}:{rng.randrange(0, 60):02d} {level} {n}: {v} took "
            f"{rng.randrange(1, 9000)} ms (batch={rng.randrange(1, 512)})"
        )
    return "tail -n 20 logs/worker.log", "\n".join(rows)


def _git(rng: random.Random) -> tuple[str, str]:
    rows = [
        f"{rng.getrandbits(28):07x} {rng.choice(['fix', 'refactor', 'add', 'speed up'])} "
        f"{rng.choice(_VERBS)} in {rng.choice(_NOUNS)}"
        for _ in range(rng.randrange(4, 8))
    ]
    return "git log --oneline -8", "\n".join(rows)


_TOOLS = (_ls, _pytest, _grep, _code, _log, _git)


def _step(rng: random.Random) -> str:
    n, v = _name(rng)
    thought = rng.choice(_THOUGHTS).format(n=n, v=v)
    command, output = rng.choice(_TOOLS)(rng)
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return (
        f"<|im_start|>assistant\n{thought}\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        f"<|im_start|>tool\n{output}<|im_end|>\n"
    )


def make_trajectory(budget: int, seed: int, item: int, encode: Encode) -> str:
    """The task and as many whole steps as fit ``budget`` tokens (at least one), closed by
    the agent's report."""
    rng = random.Random(f"memory:{seed}:trajectory:{item}")
    task = rng.choice(_TASKS).format(n=rng.choice(_NOUNS))
    head = f"<|im_start|>user\n{task}<|im_end|>\n"
    tail = "<|im_start|>assistant\nDone: the fix is in place and the tests pass again.<|im_end|>\n"
    used = len(encode(head)) + len(encode(tail))
    steps: list[str] = []
    while True:
        step = _step(rng)
        size = len(encode(step))
        if steps and used + size > budget:
            break
        steps.append(step)
        used += size
    return head + "".join(steps) + tail
