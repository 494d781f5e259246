"""Process settings that must hold before ``debug_gym`` is imported.

debug-gym creates ``~/.config/debug_gym`` and ``~/.cache/debug_gym`` at import time, and
litellm (imported through swesmith) fetches a cost map from the network at import unless
told otherwise. So HOME points at a throwaway folder and the libraries stay offline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

IMPORT_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",  # its "no PyTorch" notice is expected here
}


def isolate(home: Path) -> None:
    """Point HOME (hence debug-gym's config and cache dirs) at ``home``; stay offline.

    HOME is also what the agent's shell commands see (the local terminal inherits the
    environment), so nothing an episode does lands in the real home directory.

    Raises:
        RuntimeError: debug_gym was already imported with another HOME.
    """
    home.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"] = str(home)
    for key, value in IMPORT_ENV.items():
        os.environ.setdefault(key, value)
    constants = sys.modules.get("debug_gym.constants")
    if constants is not None:
        cache = Path(constants.DEBUG_GYM_CACHE_DIR)
        if not cache.is_relative_to(home):
            raise RuntimeError(
                f"debug_gym was imported before its home was set (its cache is {cache}); "
                "call isolate() before importing debug_gym"
            )
