"""``leyline eval NAME``: each eval is a module with ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> int``, imported lazily (no torch at parse time).

Every eval writes ``report.json``, ``report.md`` and PNG plots to ``--out`` (default
``results/<name>-<UTC time>``) and has ``--fast``, the short mode that CI runs.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

DESCRIPTION = """\
Run one eval and write its report: report.json (every figure and the configuration),
report.md (tables) and PNG plots, in --out (default results/<name>-<UTC time>).
Each has --fast, a short mode (the one CI runs); `leyline eval NAME --help` says more.
"""

# name -> module; the order is the order of `leyline eval --help`.
EVALS: dict[str, str] = {
    "mechanism": "leyline.evals.mechanism.cli",
    "fidelity": "leyline.evals.fidelity.cli",
    "compose": "leyline.evals.compose.cli",
    "memory": "leyline.evals.memory.cli",
    "pressure": "leyline.evals.pressure.cli",
    "erratum": "leyline.evals.erratum.cli",
    "proxy": "leyline.evals.proxy.cli",
    "robustness": "leyline.evals.robustness.cli",
    "debug-gym": "leyline.evals.debug_gym.launcher",
}


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "eval",
        help="run an eval (mechanism, fidelity, compose, memory, pressure, erratum, proxy, "
        "robustness, debug-gym) "
        "and write its report",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evals = parser.add_subparsers(dest="eval_name", metavar="NAME", required=True)
    for name, module_name in EVALS.items():
        module = importlib.import_module(module_name)
        sub = evals.add_parser(
            name,
            help=module.HELP,
            description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
