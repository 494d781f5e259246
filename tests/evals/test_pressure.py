"""``leyline eval pressure`` end to end on the real SmolLM2 weights (a small configuration).

Under the same budget, the evict arm must lose sessions and re-prefill them, the decay arm
must keep every session by dropping decay spans, mirror each drop (a 409, then the stub)
and prefill no more than the unbounded arm: what the eval reports is what happened.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leyline.evals.pressure.run import Config, run_pressure

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_decay_spans_spare_the_re_prefill_that_eviction_costs(tmp_path: Path) -> None:
    out = run_pressure(Config(agents=2, turns=4, budget=0.6, progress=False), tmp_path / "p")
    report = json.loads((out / "report.json").read_text())
    unbounded, evict, decay = (report["summary"][a] for a in ("unbounded", "evict", "decay"))
    assert unbounded["evictions_seen"] == 0 and unbounded["spans_dropped"] == 0
    assert unbounded["first_token_agreement"] == 1.0
    assert evict["evictions_seen"] > 0
    assert evict["re_prefilled_tokens"] > unbounded["re_prefilled_tokens"]
    assert decay["evictions_seen"] == 0 and decay["spans_dropped"] > 0
    assert decay["retries"] > 0  # each drop was learned from a 409 and mirrored
    assert decay["prefilled_tokens"] <= unbounded["prefilled_tokens"]
    assert decay["prompt_tokens"] < unbounded["prompt_tokens"]  # stubs stand in the prompts
    assert (out / "report.md").read_text().count("|") > 20
