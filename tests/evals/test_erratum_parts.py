"""`leyline eval erratum` without the model: the CLI's imports and options, the intervals,
the case draw and the field-early prompt."""

from __future__ import annotations

import pytest

from leyline.cli.main import main
from leyline.evals.common.stats import wilson
from leyline.evals.erratum.body import FAST_SECTIONS, SECTIONS, body
from leyline.evals.erratum.early import parts
from leyline.evals.erratum.templates import TEMPLATES, draw_cases
from tests.meta.fresh_python import eval_cli_loads


def test_cli_module_does_not_import_torch() -> None:
    assert "torch" not in eval_cli_loads("erratum")


def test_wilson_interval() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(0, 4)
    assert low == 0.0 and high == pytest.approx(0.4899, abs=1e-4)
    low, high = wilson(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(10, 10)[1] == 1.0


def test_cases_change_the_rule_answer_both_ways() -> None:
    for template in TEMPLATES:
        cases = draw_cases(template, 6, seed=3)
        assert cases == draw_cases(template, 6, seed=3)  # seeded
        for case in cases:
            assert template.answer(case.old) != template.answer(case.new)
            # The field line sits inside the record with other lines after it.
            assert case.before.endswith(f"{template.field}:") and case.after.count("\n") >= 3
        assert [template.answer(c.new) for c in cases] == [True, False] * 3
        shots = template.shots()
        assert shots.count(f"{template.label}: yes") == shots.count(f"{template.label}: no") == 3


def test_field_early_prompt_puts_the_record_first() -> None:
    case = draw_cases(TEMPLATES[0], 1, seed=0)[0]
    before, after = parts(case, body())
    assert before.count("\n") <= 3 and before.endswith(f"{case.template.field}:")
    assert after.endswith(SECTIONS[-1] + "\n\n") and case.template.rule in after
    # ~1,000 tokens of static text by default, a prefix of it in the fast mode.
    assert len(body()) > 4500 and body().startswith(body(FAST_SECTIONS))
    assert len(body(FAST_SECTIONS)) < len(body()) / 2


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["eval", "erratum", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    names = ("model", "cases", "early-cases", "seed", "out", "fast")
    assert all(f"--{name}" in text for name in names)
