"""How every eval's plot is finished: laid out, written as a PNG, closed (matplotlib is
optional, so it is imported only here, when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay ``fig`` out tightly, write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
