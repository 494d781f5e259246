"""What every ``leyline eval`` shares: the results folder, progress bars, Markdown tables."""

from .progress import progress
from .report import Report, markdown_table, results_dir

__all__ = ["Report", "markdown_table", "progress", "results_dir"]
