"""Tiny random-weight DeepSeek-V2 / V3 models: MLA cache layouts without downloading anything.

These are for tests and MLA demos only; :class:`LoadedModel.random_weights` is set, so every
report labels them RANDOM WEIGHTS. MoE is switched off (``first_k_dense_replace`` equals the
layer count) so they build in a second and run on CPU.

With transformers' default init (std 0.02) the outputs are near-uniform and cannot tell a
right splice from a wrong one; ``initializer_range=0.15`` makes attention sharp enough that
they can (measured: correct rotation agrees with re-prefill far more often than no rotation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoTokenizer,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from leyline.engine.models.loaded import LoadedModel

MlaVersion = Literal["v2", "v3"]


def tiny_mla_config(
    version: MlaVersion,
    *,
    rope_parameters: dict[str, Any] | None = None,
    **overrides: Any,
) -> DeepseekV2Config | DeepseekV3Config:
    """Config of a 3-layer, hidden-256 MLA model (latent 64, rope band 16, nope 32, v 32)."""
    layers = int(overrides.pop("num_hidden_layers", 3))
    common: dict[str, Any] = {
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "first_k_dense_replace": layers,  # every layer dense: no MoE
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "max_position_embeddings": 4096,
        "initializer_range": 0.15,
        "rope_parameters": rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }
    if version == "v3":
        common.update(n_group=1, topk_group=1)
    common.update(overrides)
    config_cls = DeepseekV2Config if version == "v2" else DeepseekV3Config
    return config_cls(**common)


def build_tiny_mla(
    version: MlaVersion = "v3",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    rope_parameters: dict[str, Any] | None = None,
    **overrides: Any,
) -> LoadedModel:
    """A seeded random DeepSeek-``version`` causal LM (no tokenizer: address it in token ids)."""
    config = tiny_mla_config(version, rope_parameters=rope_parameters, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: DeepseekV2ForCausalLM | DeepseekV3ForCausalLM
        if isinstance(config, DeepseekV2Config):  # version "v2"
            model = DeepseekV2ForCausalLM(config)
        else:
            model = DeepseekV3ForCausalLM(config)
    model = model.to(dtype).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) stub
    name = f"tiny-mla-{version}"
    return LoadedModel(model, None, name, f"random:{name}:seed={seed}", random_weights=True)


#: DeepSeek-V2's YaRN shape, scaled down. SGLang's CPU rope for MLA accepts only YaRN
#: (``deepseek_yarn``); ``mscale`` 1 with ``mscale_all_dim`` 0 puts the mscale (1.139) into
#: the cached keys, so a splice that re-applied it would show.
TINY_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}


def save_tiny_mla_dir(
    directory: Path, *, seed: int = 0, tokenizer_dir: Path | None = None, **overrides: Any
) -> Path:
    """Write a tiny DeepSeek-V2 (YaRN rope, fp32 safetensors) as an HF directory that SGLang
    serves and :func:`~leyline.engine.models.load_model` loads.

    ``tokenizer_dir``: copy that tokenizer in and size the vocabulary to it, so the server
    takes text as well as token ids. ``moe_layer_freq`` is added to the config: SGLang's
    DeepSeek-V2 reads it even with every layer dense; transformers has no such field.
    """
    tokenizer = None
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        special = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        overrides = {"vocab_size": len(tokenizer), **special, **overrides}
    overrides.setdefault("max_position_embeddings", 4096)
    loaded = build_tiny_mla("v2", seed=seed, rope_parameters=TINY_YARN, **overrides)
    directory.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["moe_layer_freq"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return directory
