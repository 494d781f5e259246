"""One entry point from a model name or path to a :class:`LoadedModel`, offline only."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from leyline.core.errors import ModelNotFoundError
from leyline.engine.models.gguf import (
    SMOLLM2_HOWTO,
    SMOLLM2_NAME,
    converted_copy,
    embedded_smollm2_gguf,
)
from leyline.engine.models.loaded import LoadedModel
from leyline.engine.models.tiny_mla import build_tiny_mla

DEFAULT_MODEL = "smollm2"
_DEFAULT_ALIASES = {"smollm2", "default", SMOLLM2_NAME.lower()}


def load_model(
    source: str | Path | None = None, *, dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Load ``source``: ``None``/``"smollm2"`` (embedded default), ``"tiny-mla-v2"`` /
    ``"tiny-mla-v3"`` (random weights), a ``.gguf`` file, or an HF model directory.

    Raises:
        ModelNotFoundError: nothing loadable at ``source``; the message says how to get it.
    """
    text = DEFAULT_MODEL if source is None else str(source)
    if text.lower() in _DEFAULT_ALIASES:
        return _load_hf_dir(converted_copy(embedded_smollm2_gguf()), SMOLLM2_NAME, dtype)
    if text.lower() in {"tiny-mla-v2", "tiny-mla-v3"}:
        return build_tiny_mla("v2" if text.lower().endswith("v2") else "v3", dtype=dtype)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        name = path.name.removesuffix(".gguf")
        return _load_hf_dir(converted_copy(path), name, dtype, source=str(path))
    if path.is_dir() and (path / "config.json").is_file():
        return _load_hf_dir(path, path.name, dtype)
    if path.is_dir() and (ggufs := sorted(path.glob("*.gguf"))):
        return load_model(ggufs[0], dtype=dtype)
    raise ModelNotFoundError(
        f"no model at {text!r}: expected 'smollm2', 'tiny-mla-v2', 'tiny-mla-v3', a .gguf "
        f"file or a directory with config.json. {SMOLLM2_HOWTO}"
    )


def _load_hf_dir(
    directory: Path, name: str, dtype: torch.dtype, *, source: str | None = None
) -> LoadedModel:
    kw = {"local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), **kw)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only directory: the caller addresses it in token ids
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, **kw)
    model.eval()  # type: ignore[no-untyped-call]  # transformers' eval() is unannotated
    return LoadedModel(model, tokenizer, name, source or str(directory))
