"""`leyline eval erratum`: the fast mode on SmolLM2 end to end, its records checked against
what the engine must have done (token counts, KV kept or rewritten, prefix-cache blocks) and
against the summary, and the field-early layout's prefix-cache hits. The parts that need no
model: ``test_erratum_parts``."""

from __future__ import annotations

from typing import Any

import pytest

from leyline.evals.erratum.templates import TEMPLATES

from .fast_run import fast_run

pytestmark = [pytest.mark.slow, pytest.mark.model]  # every test reads the fast run's report

BLOCK = 16  # the prefix cache's block size (PrefixCache default)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("erratum")
    data = fast_run("erratum", out, ("report.json", "report.md", "erratum.png"))
    text = (out / "report.md").read_text()
    assert "## Decision recovery" in text and "## Prefix-cache hit rate" in text
    assert "| overall | field late |" in text and "| overall | field early |" in text
    return data


def _prompt_old(r: dict[str, Any]) -> int:
    """Tokens of the old prompt before the question: what the erratum directive kept."""
    return int(r["erratum_op"]["reused"])


def test_fast_mode_covers_every_template(report: dict[str, Any]) -> None:
    records = report["records"]
    assert [r["template"] for r in records] == [t.name for t in TEMPLATES for _ in range(2)]
    assert report["summary"]["overall"]["cases"] == len(records) == 8


def test_field_only_refresh_rewrites_the_field_and_keeps_the_downstream(
    report: dict[str, Any],
) -> None:
    for r in report["records"]:
        splice = r["splice"]
        assert splice["path"] == "splice" and splice["fallback_reason"] is None
        # Only the new value's tokens were computed; the rest of the old KV was kept.
        assert splice["prefilled"] == r["field_tokens_new"]
        moved = r["field_tokens_new"] != r["field_tokens_old"]
        assert (splice["rotated"] > 0) == moved
        assert r["field_kv_change"] > 1e-3  # the field's KV differs from the no-edit KV
        assert r["field_kv_vs_oracle"] < 1e-4  # ... and is what a recompute gives there
        assert r["downstream_kept"]  # downstream values bitwise the old ones
        assert r["downstream_vs_oracle"] > 1e-2  # which a recompute would have changed


def test_erratum_prompt_is_the_baseline_plus_the_note(report: dict[str, Any]) -> None:
    for r in report["records"]:
        sizes, note = r["prompt_tokens"], r["note_tokens"]
        question = sizes["no_edit"] - _prompt_old(r)
        assert 0 < question < 8
        assert sizes["erratum"] == sizes["no_edit"] + note
        assert r["erratum_op"]["prefilled"] == note and r["erratum_op"]["path"] == "splice"
        assert r["erratum_request"]["tokens"] == sizes["erratum"]
        shift = r["field_tokens_new"] - r["field_tokens_old"]
        assert sizes["oracle"] == sizes["field_only"] == sizes["no_edit"] + shift


def test_prefix_cache_hits_follow_the_blocks(report: dict[str, Any]) -> None:
    for r in report["records"]:
        erratum, edit = r["erratum_request"], r["edit_request"]
        for request in (r["first_request"], erratum, edit):
            assert request["reused"] + request["prefilled"] == request["tokens"]
        # The erratum request reuses the whole old prompt up to its last full block; the
        # in-prefix edit only the blocks before the field.
        assert erratum["reused"] == _prompt_old(r) // BLOCK * BLOCK
        assert edit["reused"] == r["field_start"] // BLOCK * BLOCK
        assert erratum["reused"] > edit["reused"]
    hits = report["summary"]["overall"]["hit_rate"]
    assert hits["erratum"]["hit_rate"] > hits["in_prefix_edit"]["hit_rate"]


def test_field_early_in_prefix_edit_misses_the_cache(report: dict[str, Any]) -> None:
    early = report["field_early_records"]
    assert [r["template"] for r in early] == [t.name for t in TEMPLATES]  # 1 case each (fast)
    notes = {(r["template"], r["index"]): r["note_tokens"] for r in report["records"]}
    for r in early:
        erratum, edit = r["erratum_request"], r["edit_request"]
        appended = r["note_tokens"] + r["question_tokens"]
        assert erratum["tokens"] == r["prompt_tokens"] + appended
        assert notes[r["template"], r["index"]] == r["note_tokens"]  # the directive's note
        # The same block rule as in the decision layout, measured by the engine.
        assert erratum["reused"] == r["prompt_tokens"] // BLOCK * BLOCK
        assert edit["reused"] == r["field_start"] // BLOCK * BLOCK
        # The geometry the thresholds below rest on (fast body: 3 sections, ~350 tokens).
        assert r["field_start"] < 3 * BLOCK and r["prompt_tokens"] >= 400 and appended <= 25
    # Erratum: reuses all but < 16 tokens of a >= 400-token prompt and prefills <= 25 more,
    # so its hit rate is >= (400 - 15) / (400 + 25) = 0.906. In-prefix edit: reuses at most
    # the 2 full blocks before the field (< 48 tokens in), <= 32 / 400 = 0.08 (measured
    # ~0.04: one block). The decision layout, field at ~93%, has both near 0.9.
    hits = report["summary"]["field_early"]["overall"]["hit_rate"]
    assert hits["erratum"]["hit_rate"] > 0.9
    assert hits["in_prefix_edit"]["hit_rate"] < 0.1
    assert report["summary"]["overall"]["hit_rate"]["in_prefix_edit"]["hit_rate"] > 0.8


def test_the_same_tokens_by_two_paths_give_the_same_decision_margin(
    report: dict[str, Any],
) -> None:
    for r in report["records"]:
        margins = r["margins"]
        # ERRATUM directive on a session vs the same tokens sent as a new request.
        assert abs(margins["erratum"] - r["erratum_request_margin"]) < 1e-3
        assert abs(margins["oracle"] - r["edit_request_margin"]) < 1e-3
        assert abs(margins["no_edit"] - r["first_request_margin"]) < 1e-3
        # The note's value is read: restating the old value gives another margin.
        assert abs(margins["erratum"] - margins["erratum_control"]) > 1e-3


def test_records_agree_with_the_summary(report: dict[str, Any]) -> None:
    summary, records = report["summary"], report["records"]
    qualifying_total = 0
    for name, group in summary["templates"].items():
        rows = [r for r in records if r["template"] == name]
        yes = [r["margins"]["no_edit"] for r in rows if r["rule_old"]]
        yes += [r["margins"]["oracle"] for r in rows if r["rule_new"]]
        no = [r["margins"]["no_edit"] for r in rows if not r["rule_old"]]
        no += [r["margins"]["oracle"] for r in rows if not r["rule_new"]]
        threshold = (sum(yes) / len(yes) + sum(no) / len(no)) / 2
        assert summary["thresholds"][name] == pytest.approx(threshold)
        for r in rows:
            assert r["decisions"] == {a: m > threshold for a, m in r["margins"].items()}
            assert r["qualifies"] == (r["decisions"]["no_edit"] != r["decisions"]["oracle"])
        ok = [r for r in rows if r["qualifies"]]
        assert group["qualifying"] == len(ok)
        qualifying_total += len(ok)
        for arm, rate in group["recovery"].items():
            agree = sum(r["decisions"][arm] == r["decisions"]["oracle"] for r in ok)
            assert (rate["k"], rate["n"]) == (agree, len(ok))
            if ok:
                assert rate["low"] <= rate["rate"] <= rate["high"]
        assert group["recovery"]["no_edit"]["k"] == 0  # it is the old decision, by definition
    assert summary["overall"]["qualifying"] == qualifying_total
