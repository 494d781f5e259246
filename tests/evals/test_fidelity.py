"""`leyline eval fidelity`: the fast mode end to end, its report checked against itself and
against independent computations (plain transformers forwards, fresh counts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from leyline.engine.models import load_model
from leyline.evals.fidelity.drift import ARMS, PATTERNS
from leyline.evals.fidelity.measures import kl
from leyline.evals.fidelity.prompts import make_prompt, make_prompts
from leyline.evals.fidelity.tokens import tokenize
from tests.meta.fresh_python import eval_cli_loads

from .fast_run import fast_run

PLOTS = ("key_error.png", "drift.png", "kl_hist.png")


def _run(out: Path, *extra: str) -> dict[str, Any]:
    return fast_run("fidelity", out, ("report.json", "report.md", *PLOTS), *extra)


@pytest.fixture(scope="module")
def default_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("fidelity")
    return out, _run(out)


def _check_model(data: dict[str, Any], prompts: int) -> None:
    """Everything that must hold for any model, recounted from the per-prompt records."""
    keys = data["key_error"]
    assert keys["worst"] < 1e-4 and max(keys["rotated_max"]) < 1e-4  # fp32 rotation
    assert min(keys["unrotated_min"]) > 1e-2  # not rotating would show: the check can fail
    assert keys["rest_bitwise"] and max(keys["prefill_vs_reference_max"]) < 1e-6

    for pattern in PATTERNS:
        errors = data["drift"]["errors"][pattern]
        fp32_rot, bf16_rot, fp32_all = (errors[arm] for arm in ARMS)
        assert len(fp32_rot) == 13  # step 0 (the bf16 cast) and 12 splices
        assert 5e-4 < fp32_rot[0] == bf16_rot[0] < 5e-3 and fp32_all[0] == 0.0
        assert fp32_rot[-1] < bf16_rot[-1] and fp32_all[-1] < 1e-5

    records = data["records"]
    assert [r["id"] for r in records] == [f"p{i:04d}" for i in range(prompts)]
    assert all(r["path"] == "splice" for r in records)
    assert all(min(r[k] for k in r if k.startswith("kl_")) > -1e-9 for r in records)
    counts = data["agreement"]["counts"]
    assert counts["prompts"] == prompts
    assert counts["splice_eq_full"] == sum(r["argmax_splice"] == r["argmax_full"] for r in records)
    assert counts["splice_eq_reprefill"] == sum(
        r["argmax_splice"] == r["argmax_reprefill"] for r in records
    )
    divergent = [r for r in records if r["argmax_full"] != r["argmax_reprefill"]]
    d = data["agreement"]["divergent"]
    assert d["prompts"] == len(divergent) == prompts - counts["full_eq_reprefill"]
    followed = [d[f"splice_follows_{k}"] for k in ("full", "reprefill", "neither")]
    assert sum(followed) == len(divergent)
    assert followed[0] == sum(r["argmax_splice"] == r["argmax_full"] for r in divergent)


def _check_labels(report_md: str, data: dict[str, Any]) -> None:
    """Random-weight models are labelled wherever a heading or table row names them."""
    name = data["label"].split(" ")[0]
    lines = [ln for ln in report_md.splitlines() if name in ln and ln.startswith(("#", "|"))]
    assert lines and all("RANDOM WEIGHTS" in ln for ln in lines)


def _plain_logits(model: torch.nn.Module, tokens: tuple[int, ...]) -> torch.Tensor:
    ids = torch.tensor([list(tokens)])
    return model(input_ids=ids, use_cache=False).logits[0, -1].float()


@torch.inference_mode()
def _check_against_plain_forward(name: str, record: dict[str, Any], seed: int = 0) -> None:
    """Full-context and re-prefill figures of prompt 0, recomputed by transformers alone."""
    loaded = load_model(name)
    tp = tokenize(make_prompt(seed, 0), loaded.tokenizer, int(loaded.model.config.vocab_size))
    full = _plain_logits(loaded.model, tp.tokens)
    reprefill = _plain_logits(loaded.model, tp.edited)
    assert record["length"] == len(tp.tokens) and record["delta"] == tp.delta
    assert record["argmax_full"] == int(full.argmax())
    assert record["argmax_reprefill"] == int(reprefill.argmax())
    assert abs(record["kl_reprefill_vs_full"] - kl(full, reprefill)) < 1e-4


def test_prompts_are_seeded_and_the_span_is_exact() -> None:
    first = make_prompts(3, 20)
    assert first == make_prompts(3, 20) and first != make_prompts(4, 20)
    assert make_prompt(3, 7) == first[7]  # prompt i does not depend on the count
    assert {p.kind for p in make_prompts(0, 40)} == {"removed", "kept", "continue"}
    tp = tokenize(first[0], None, 1000)
    assert tp.edited[tp.start : tp.start + len(tp.stub)] == tp.stub
    assert tp.edited[tp.start + len(tp.stub) :] == tp.tokens[tp.end :]
    assert len(tp.edited) == len(tp.tokens) + tp.delta and tp.delta < 0


def test_cli_module_does_not_import_torch() -> None:
    assert "torch" not in eval_cli_loads("fidelity")


def test_fast_run_on_tiny_mla_v3(tmp_path: Path) -> None:
    report = _run(tmp_path, "--model", "tiny-mla-v3")
    data = report["models"]["tiny-mla-v3"]
    assert data["random_weights"] and "RANDOM WEIGHTS" in data["label"]
    assert data["layout"].startswith("mla-latent slot 1") and data["layout"].endswith("half")
    _check_model(data, prompts=4)
    _check_labels((tmp_path / "report.md").read_text(), data)
    _check_against_plain_forward("tiny-mla-v3", data["records"][0])


@pytest.mark.slow
@pytest.mark.model
def test_fast_run_default_models(default_report: tuple[Path, dict[str, Any]]) -> None:
    out, report = default_report
    assert set(report["models"]) == {"smollm2", "tiny-mla-v2"}
    assert report["config"]["prompts"] == 4 and report["config"]["max_splices"] == 12
    smol, mla = report["models"]["smollm2"], report["models"]["tiny-mla-v2"]
    assert not smol["random_weights"] and mla["random_weights"]
    for data in (smol, mla):
        _check_model(data, prompts=4)
    _check_labels((out / "report.md").read_text(), mla)
    assert len(smol["key_error"]["rotated_max"]) == 30 and "text" in smol["records"][0]
    # Real weights: the rotation is what keeps the splice near a re-prefill.
    kls = smol["agreement"]["kl"]
    assert kls["kl_splice_vs_reprefill"]["median"] < kls["kl_control_vs_reprefill"]["median"] / 5
    _check_against_plain_forward("smollm2", smol["records"][0])


def test_fast_run_reports_bf16_beside_fp32(tmp_path: Path) -> None:
    report = _run(tmp_path, "--model", "tiny-mla-v3", "--dtype", "float32", "--dtype", "bfloat16")
    assert set(report["models"]) == {"tiny-mla-v3", "tiny-mla-v3@bfloat16"}
    fp32, bf16 = report["models"]["tiny-mla-v3"], report["models"]["tiny-mla-v3@bfloat16"]
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert "bfloat16" in bf16["label"] and "RANDOM WEIGHTS" in bf16["label"]
    # bf16 keys carry bf16 rounding, yet the rotation is still what moves them into place.
    assert fp32["key_error"]["worst"] < 1e-4 < bf16["key_error"]["worst"] < 3e-2
    assert min(bf16["key_error"]["unrotated_min"]) > 10 * bf16["key_error"]["worst"]
    assert all(r["path"] == "splice" for r in bf16["records"])
    assert "bfloat16" in (tmp_path / "report.md").read_text()
