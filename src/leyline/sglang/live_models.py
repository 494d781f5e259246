"""The HF directories a live CPU SGLang server is checked on (``make sglang-live-check``).

    python -m leyline.sglang.live_models smollm2       # prints the directory
    python -m leyline.sglang.live_models tiny-mla-v2

Both come from what the main venv already has, never from a hub: ``smollm2`` is the fp32
copy of the embedded SmolLM2 GGUF (GQA); ``tiny-mla-v2`` is a seeded random DeepSeek-V2
with YaRN rope (MLA) and SmolLM2's tokenizer, so both servers take text and token ids alike.
Each is built once into the cache dir (atomic, verified) and reused; the same directory is
served by SGLang and loaded by the reference engine.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import transformers

from leyline.engine.models.gguf import converted_copy, embedded_smollm2_gguf
from leyline.engine.models.local_copy import cache_root, ensure_copy
from leyline.engine.models.tiny_mla import TINY_YARN, save_tiny_mla_dir

MODELS = ("smollm2", "tiny-mla-v2")
TINY_MLA_FORMAT = 1  # bump when save_tiny_mla_dir changes what it writes


def smollm2_dir() -> Path:
    return converted_copy(embedded_smollm2_gguf())


def tiny_mla_dir(seed: int = 0) -> Path:
    tokenizer = smollm2_dir()
    source: dict[str, object] = {
        "builder": "tiny-mla-v2",
        "format": TINY_MLA_FORMAT,
        "seed": seed,
        "rope": repr(sorted(TINY_YARN.items())),
        "tokenizer": str(tokenizer),
        "transformers": transformers.__version__,  # random init may differ across versions
    }
    key = hashlib.sha256(repr(sorted(source.items())).encode()).hexdigest()[:12]
    directory = cache_root() / "models" / f"tiny-mla-v2-yarn-{key}"
    return ensure_copy(
        directory, source, lambda tmp: save_tiny_mla_dir(tmp, seed=seed, tokenizer_dir=tokenizer)
    )


def model_dir(name: str) -> Path:
    if name == "smollm2":
        return smollm2_dir()
    if name == "tiny-mla-v2":
        return tiny_mla_dir()
    raise ValueError(f"unknown live model {name!r}; one of {', '.join(MODELS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=MODELS)
    print(model_dir(parser.parse_args().model))


if __name__ == "__main__":
    main()
