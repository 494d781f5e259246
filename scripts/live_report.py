"""Print the figures a live suite run recorded (tests/live, LEYLINE_LIVE_REPORT): one row per
check, its measured values (log-prob gaps in nats, counts) and, where the check recorded
the server's answer, that answer's path and token counts.

    python scripts/live_report.py FIGURES_JSONL
"""

from __future__ import annotations

import json
import sys
from typing import Any

ANSWER_FIELDS = ("path", "reused_tokens", "rotated_tokens", "fallback_reason")


def row(figures: dict[str, Any]) -> str:
    check = figures.pop("check")
    answer = figures.pop("response", None) or {}
    figures.pop("turn", None)  # the next turn's whole report: too long for a row
    cells = [f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()]
    cells += [f"{k} {answer[k]}" for k in ANSWER_FIELDS if answer.get(k) is not None]
    return f"    {check:<44} " + ", ".join(cells)


def main(path: str) -> None:
    with open(path) as lines:
        for line in lines:
            print(row(json.loads(line)))


if __name__ == "__main__":
    main(sys.argv[1])
