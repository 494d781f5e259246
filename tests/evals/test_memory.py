"""`leyline eval memory`: the seeded profiles, trajectories and questions, and the fast mode
end to end on SmolLM2 (its arms checked against each other and against a plain
transformers forward)."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
import torch

from leyline.cli.main import main
from leyline.engine.models import load_model
from leyline.evals.compose.measures import Agreement
from leyline.evals.memory.arms import (
    EARLY,
    LATE,
    Cost,
    ItemResult,
    Score,
    Versus,
    arm_names,
)
from leyline.evals.memory.cases import Item, make_item
from leyline.evals.memory.cli import FAST
from leyline.evals.memory.markdown import sections
from leyline.evals.memory.plots import plot_accuracy_vs_cost
from leyline.evals.memory.profiles import FIELD_BY_KEY, FIELDS, make_profile, update
from leyline.evals.memory.summary import arm_rows, by_length, setup
from leyline.evals.memory.trajectory import make_trajectory
from tests.meta.fresh_python import eval_cli_loads

from .fast_run import fast_run

FILES = ("report.json", "report.md", "accuracy_vs_cost.png")


def _words(text: str) -> list[int]:
    """A stand-in tokenizer: one stable id per word, punctuation mark or newline."""
    return [
        int.from_bytes(hashlib.blake2b(w.encode(), digest_size=2).digest(), "little")
        for w in re.findall(r"\w+|[^\w\s]|\n", text)
    ]


def test_profiles_are_seeded_and_an_update_changes_what_it_says() -> None:
    profile = make_profile(30, 0, 3)
    assert profile == make_profile(30, 0, 3) != make_profile(30, 1, 3)
    assert len(profile.facts) == 30 and len({k for k, _ in profile.facts}) == 30
    assert all(v in FIELD_BY_KEY[k].pool for k, v in profile.facts)
    new, changed = update(profile, 4, 0)
    assert len(changed) == 4 and new.version == profile.version + 1
    for (key, old), (same_key, value) in zip(profile.facts, new.facts, strict=True):
        assert key == same_key and (old != value) == (key in changed)
    text = new.render()
    assert all(f": {v}\n" in text or f": {v}<|im_end|>" in text for _, v in new.facts)
    # The version line comes first, so the rendered blocks differ from it on.
    first = profile.render().splitlines()[1]
    assert first != new.render().splitlines()[1] and str(new.version) in new.render()
    with pytest.raises(ValueError):
        make_profile(len(FIELDS) + 1, 0, 0)


def test_trajectories_fit_their_budget_and_grow_by_whole_steps() -> None:
    short, long = (make_trajectory(n, 0, 2, _words) for n in (200, 900))
    assert len(_words(short)) <= 200 < len(_words(long)) <= 900
    tail = short[short.rindex("<|im_start|>assistant\nDone") :]
    assert long.startswith(short.removesuffix(tail)) and long.endswith(tail)
    assert short == make_trajectory(200, 0, 2, _words) != make_trajectory(200, 0, 3, _words)
    assert not any(v in long for f in FIELDS for v in f.pool if len(v) > 4)  # unrelated


def test_items_ask_distinct_candidates_about_the_new_profile() -> None:
    item = make_item(
        1, facts=20, changes=4, budget=400, questions=6, choices=5, encode=_words, seed=0
    )
    assert item == make_item(
        1, facts=20, changes=4, budget=400, questions=6, choices=5, encode=_words, seed=0
    )
    assert len(item.questions) == 6 and sum(q.changed for q in item.questions) == 3
    for q in item.questions:
        assert q.candidates[0] == item.new.value(q.key) and len(q.candidates) == 5
        assert set(q.candidates) <= set(FIELD_BY_KEY[q.key].pool)
        assert len(set(q.candidate_tokens)) == 5 and q.changed == (q.key in item.changed)
    assert item.early == item.system + item.profile + item.trajectory
    assert item.base == item.system + item.trajectory
    # The update changes the early sequence from the profile's version line on.
    same = next(
        i for i, (a, b) in enumerate(zip(item.early_old, item.early, strict=False)) if a != b
    )
    assert len(item.system) < same < len(item.system) + 16


def _fake(item: Item, arms: list[str]) -> ItemResult:
    """Made-up figures: early answers wrong, every other arm right; costs by arm order."""
    n = len(item.questions)
    agreement = Agreement(0.1, 0.99, 0.98, True, 0.3, False, True)
    return ItemResult(
        item,
        {a: Cost(0.5 / (i + 1), 100 // (i + 1), 7, "splice") for i, a in enumerate(arms)},
        0.2,
        1.0,
        1000,
        {a: [Score((-1.0, -2.0 if a != EARLY else 0.0), a != EARLY, False, 0.6)] * n for a in arms},
        {a: [Versus(agreement, 0.0 if a == LATE else 0.5)] * n for a in arms},
    )


def test_the_report_sections_and_plot_by_length(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    arms = arm_names((0, 16))
    results = [
        _fake(
            make_item(i, facts=10, changes=2, budget=b, questions=4, choices=2, encode=_words,
                      seed=0),
            arms,
        )
        for b in (200, 600)
        for i in range(3)
    ]  # fmt: skip
    summary = {
        "arms": arm_rows(results, arms),
        "by_length": by_length(results, arms),
        "setup": setup(results),
        "all_finite": True,
        "fallbacks": 0,
    }
    rows = {r["arm"]: r for r in summary["arms"]}
    assert rows[EARLY]["accuracy"]["rate"] == 0 and rows[LATE]["accuracy"]["rate"] == 1
    assert rows[LATE]["accuracy"]["n"] == 24 and rows[LATE]["cost"]["speedup_vs_early"] == 2
    assert [r["items"] for r in summary["by_length"]] == [3, 3]
    text = "\n".join(f"## {h}\n{b}" for h, b in sections(summary))
    assert "## By trajectory length" in text and "24/24" in text and "0/24" in text
    assert "0.250 s (50)" in text  # late_full: half the early TTFT, half its tokens
    plot_accuracy_vs_cost(summary, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_cli_module_does_not_import_torch() -> None:
    assert "torch" not in eval_cli_loads("memory")


def test_bad_sizes_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "memory", "--questions", "9", "--facts", "4"]) == 2
    assert main(["eval", "memory", "--choices", "40"]) == 2
    assert "--choices" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fast_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return fast_run("memory", tmp_path_factory.mktemp("memory"), FILES)


def _arms(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["arm"]: row for row in report["summary"]["arms"]}


@pytest.mark.slow
@pytest.mark.model
def test_fast_run(fast_report: dict[str, Any]) -> None:
    config, summary, records = fast_report["config"], fast_report["summary"], fast_report["records"]
    assert config["fast"] and not config["random_weights"] and config["seams"] == "0,16,512"
    arms = _arms(fast_report)
    assert list(arms) == [
        "early_full",
        "late_full",
        "late_compose_k0",
        "late_compose_k16",
        "late_compose_k512",
        "none",
    ]
    assert len(records) == FAST.items and summary["all_finite"] and summary["fallbacks"] == 0
    questions = FAST.items * FAST.questions
    for row in arms.values():
        rate = row["accuracy"]
        assert rate["n"] == questions and 0.0 <= rate["rate"] <= 1.0
        assert 0.0 <= rate["ci95"][0] <= rate["rate"] <= rate["ci95"][1] <= 1.0
        assert 0.0 <= row["p_right_mean"] <= 1.0 and row["greedy"]["n"] == questions
    # The profile matters: without it the right value is far less likely.
    assert arms["late_full"]["p_right_mean"] > 2 * arms["none"]["p_right_mean"]
    for r in records:
        profile = r["tokens"]["profile"]
        assert profile < 512  # so K = 512 recomputes the whole profile
        costs = r["costs"]
        q0 = costs["none"]["prefilled"]  # the first question alone
        assert costs["late_full"]["prefilled"] == profile + q0
        assert costs["late_compose_k512"]["prefilled"] == profile + q0
        # A compose prefills its seam and the question (and reruns the profile's last token).
        assert costs["late_compose_k0"]["prefilled"] == q0 + 1
        assert costs["late_compose_k16"]["prefilled"] == 16 + q0 + 1
        assert {costs[f"late_compose_k{k}"]["path"] for k in (0, 16, 512)} == {"splice"}
        # Early placement re-prefills everything after the profile's version line.
        early = costs["early_full"]
        assert early["reused"] < r["tokens"]["system"] + 12
        assert early["prefilled"] > profile + r["tokens"]["trajectory"]
        for q in r["questions"]:
            # K >= the profile's length recomputes it all: equal to late_full (fp32 noise).
            whole = q["arms"]["late_compose_k512"]["vs_late"]
            assert whole["max_dlogp_top20"] <= 1e-4 and abs(whole["kl"]) <= 1e-6
            assert q["arms"]["late_full"]["vs_late"]["kl"] == 0
    assert (
        arms["late_compose_k0"]["cost"]["seconds_median"]
        < arms["early_full"]["cost"]["seconds_median"]
    )
    assert arms["late_compose_k0"]["vs_late"]["kl_mean"] > 1e-3  # composing is approximate


@pytest.mark.slow
@pytest.mark.model
@torch.inference_mode()
def test_the_prefilled_arms_are_a_plain_forward(fast_report: dict[str, Any]) -> None:
    """Record 0's first question, early and late, recomputed by transformers alone on the
    whole sequence: the candidates' log-probabilities agree."""
    loaded = load_model("smollm2")

    def encode(text: str) -> list[int]:
        return list(loaded.tokenizer.encode(text, add_special_tokens=False))

    item = make_item(
        0,
        facts=FAST.facts,
        changes=4,
        budget=FAST.trajectory[0],
        questions=FAST.questions,
        choices=5,
        encode=encode,
        seed=0,
    )
    record = fast_report["records"][0]
    q = item.questions[0]
    assert record["questions"][0]["candidates"] == list(q.candidates)
    for arm, context in (
        ("early_full", item.early),
        ("late_full", item.base + item.profile),
        ("none", item.base),
    ):
        ids = torch.tensor([list(context + q.tokens)])
        logits = loaded.model(input_ids=ids, use_cache=False).logits[0, -1].double()
        logp = torch.log_softmax(logits, -1)[list(q.candidate_tokens)]
        got = record["questions"][0]["arms"][arm]["logps"]
        assert max(abs(a - b) for a, b in zip(logp.tolist(), got, strict=True)) < 1e-4, arm
