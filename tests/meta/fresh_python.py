"""What a module pulls in when it is imported by a new interpreter (nothing loaded before)."""

from __future__ import annotations

import subprocess
import sys

WATCHED = ("torch", "transformers", "sglang")


def loaded_in_fresh_python(statement: str) -> list[str]:
    """Run ``statement`` in a new interpreter; the packages of ``WATCHED`` it loaded."""
    code = f"import sys\n{statement}\nprint(*[m for m in {WATCHED!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1].split()


def eval_cli_loads(name: str) -> list[str]:
    """``leyline.evals.<name>.cli`` has the eval interface; what importing it loaded."""
    return loaded_in_fresh_python(
        f"import leyline.evals.{name}.cli as c\n"
        "assert c.HELP and c.DESCRIPTION and callable(c.add_arguments) and callable(c.run)"
    )
