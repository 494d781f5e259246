"""Run the fidelity eval on each model and write the report (JSON, Markdown, PNG)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from leyline.engine.engine import Engine
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.models import load_model
from leyline.evals.common import Report, progress, results_dir

from .agreement import PromptRecord, compare_prompt
from .drift import drift
from .keys import KeyErrors, key_errors
from .markdown import model_sections, overview
from .plots import plot_drift, plot_key_error, plot_kl_hist
from .prompts import make_prompts
from .summary import summarize_agreement, summarize_drift, summarize_keys
from .tokens import TokenizedPrompt, tokenize

KEY_METHOD = (
    "rope band of the spliced downstream keys vs the same attention modules re-run on the "
    "same hidden states with transformers' rotary embedding at positions p + delta"
)


@dataclass(frozen=True, slots=True)
class FidelityOptions:
    models: tuple[str, ...]
    prompts: int
    max_splices: int
    key_prompts: int
    """Prompts whose per-layer key error is measured (the first ones)."""
    drift_tokens: int
    """Downstream tokens of the first prompt whose rope band the drift arms rotate."""
    seed: int
    out: Path | None
    progress: bool = True
    dtypes: tuple[str, ...] = ("float32",)
    """Weights and cache dtypes: each model runs in each (``bfloat16`` entries are keyed
    ``<model>@bfloat16``)."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_fidelity(options: FidelityOptions) -> Path:
    folder = results_dir("fidelity", options.out)
    models: dict[str, dict[str, Any]] = {}
    for name in options.models:
        for dtype in options.dtypes:
            key = name if dtype == "float32" else f"{name}@{dtype}"
            models[key] = run_model(name, options, DTYPES[dtype])
    config = {
        "models": ",".join(options.models),
        "dtypes": ",".join(options.dtypes),
        "prompts": options.prompts,
        "max_splices": options.max_splices,
        "key_prompts": options.key_prompts,
        "drift_tokens": options.drift_tokens,
        "seed": options.seed,
        "torch_threads": torch.get_num_threads(),
    }
    report = Report("fidelity", "Fidelity: splice vs full context vs re-prefill", config, folder)
    report.data["key_error_method"] = KEY_METHOD
    report.data["models"] = models
    report.section("Overview", overview(models) + "\n\n" + _random_note(models))
    for data in models.values():
        for heading, body in model_sections(data):
            report.section(heading, body)
    report.plots = {
        "key_error.png": lambda p: plot_key_error(models, p),
        "drift.png": lambda p: plot_drift(models, p),
        "kl_hist.png": lambda p: plot_kl_hist(models, p),
    }
    report.write()
    return folder


def _random_note(models: dict[str, dict[str, Any]]) -> str:
    random = [d["label"] for d in models.values() if d["random_weights"]]
    if not random:
        return ""
    return (
        f"{', '.join(random)}: RANDOM WEIGHTS. Their key error and drift are real numerics of "
        "the MLA layout; their agreement figures only show that the mechanism runs (prompts "
        "are hashed words, predictions mean nothing)."
    )


@torch.inference_mode()
def run_model(
    name: str, options: FidelityOptions, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    t0 = time.perf_counter()
    loaded = load_model(name, dtype=dtype)
    engine = Engine(loaded)
    if engine.layout is None or engine.rope is None:
        raise RuntimeError(f"{loaded.label}: splices unsupported ({engine.splice_refusal})")
    prompts = [
        tokenize(p, engine.tokenizer, engine.vocab_size)
        for p in make_prompts(options.seed, options.prompts)
    ]
    records: list[PromptRecord] = []
    keys: list[KeyErrors] = []
    drift_bands: list[torch.Tensor] = []
    bar = progress(prompts, desc=loaded.label, enabled=options.progress)
    for i, tp in enumerate(bar):
        compared = compare_prompt(engine, tp)
        records.append(compared.record)
        if i < options.key_prompts:
            keys.append(key_errors(engine, tp, compared.before, compared.after))
        if i == 0:
            drift_bands = _downstream_bands(engine, tp, compared.before, options.drift_tokens)
        del compared
    drifted = drift(
        drift_bands, engine.rope.inv_freq, engine.layout.pairing, options.max_splices, options.seed
    )
    layout = engine.layout
    return {
        "label": loaded.label,
        "dtype": str(dtype).removeprefix("torch."),
        "random_weights": loaded.random_weights,
        "source": loaded.source,
        "layout": f"{layout.kind} slot {layout.slot} dims [{layout.offset}, "
        f"{layout.offset + layout.width}) {layout.pairing}",
        "rope_type": engine.rope.rope_type,
        "seconds": time.perf_counter() - t0,
        "agreement": summarize_agreement(records),
        "records": [_record_json(r, engine) for r in records],
        "key_error": {**summarize_keys(keys), "per_prompt": [asdict(k) for k in keys]},
        "drift": {**summarize_drift(drifted), **asdict(drifted)},
    }


def _downstream_bands(
    engine: Engine, tp: TokenizedPrompt, kv: KVCache, tokens: int
) -> list[torch.Tensor]:
    layout = engine.layout
    assert layout is not None
    stop = min(tp.end + tokens, len(tp.tokens))
    band = slice(layout.offset, layout.offset + layout.width)
    return [layer[layout.slot][..., tp.end : stop, band].clone() for layer in kv]


def _record_json(record: PromptRecord, engine: Engine) -> dict[str, Any]:
    out: dict[str, Any] = {**asdict(record), "follows": record.follows}
    if engine.tokenizer is not None:
        arms = {"full": record.argmax_full, "reprefill": record.argmax_reprefill}
        arms |= {"splice": record.argmax_splice, "control": record.argmax_control}
        if record.answer_token is not None:
            arms["answer"] = record.answer_token
        out["text"] = {arm: engine.decode([token]) for arm, token in arms.items()}
    return out
