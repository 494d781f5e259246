"""Model loading for the reference engine: offline only (the hub is never contacted)."""

from __future__ import annotations

import os

# huggingface_hub reads this when first imported; loaders also pass local_files_only=True
# so the hub stays untouched even if something imported it earlier.
os.environ["HF_HUB_OFFLINE"] = "1"

from leyline.engine.models.gguf import converted_copy, embedded_smollm2_gguf
from leyline.engine.models.load import DEFAULT_MODEL, load_model
from leyline.engine.models.loaded import LoadedModel
from leyline.engine.models.local_copy import cache_root, verify_copy
from leyline.engine.models.tiny_mla import build_tiny_mla, tiny_mla_config

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "build_tiny_mla",
    "cache_root",
    "converted_copy",
    "embedded_smollm2_gguf",
    "load_model",
    "tiny_mla_config",
    "verify_copy",
]
