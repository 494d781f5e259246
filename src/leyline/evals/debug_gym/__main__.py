"""``python -m leyline.evals.debug_gym --help``."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
