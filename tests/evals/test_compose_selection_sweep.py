"""The selection-layer sweep: its KL per layer and its summary."""

from __future__ import annotations

import math

import torch

from leyline.evals.compose.selection_sweep import item_kls, summarise

from ._compose_scene import tiny_scene


def test_the_summary_is_the_geometric_mean_of_the_ratios_to_the_first_layer() -> None:
    rows = [
        ("passage", 500, False, 0, {1: 0.04, 4: 0.02}),
        ("passage", 500, False, 1, {1: 0.01, 4: 0.02}),
        ("tools", 400, True, 0, {1: 0.10, 4: 0.05}),
    ]
    lines = summarise(rows)
    ratio = math.exp((math.log(0.5) + math.log(2.0) + math.log(0.5)) / 3)
    assert lines[0] == f"layer 4 vs 1: KL x{ratio:.3f} (geometric mean), lower in 2/3 items"
    assert "passage 500 plain: s1 0.0250  s4 0.0200" in lines
    assert "tools 400 anchored: s1 0.1000  s4 0.0500" in lines


@torch.inference_mode()
def test_recomputing_the_whole_block_matches_the_prefill_at_every_layer() -> None:
    scene = tiny_scene(layers=4)
    engine, prefix, skill, question = scene.engine, scene.prefix, scene.skill, scene.question
    before = engine.recompute_selection_layer
    whole = item_kls(engine, prefix, skill, question, (1, 2), seam=4, ratio=1.0, answer=None)
    part = item_kls(engine, prefix, skill, question, (1, 2), seam=4, ratio=0.1, answer=None)
    assert engine.recompute_selection_layer == before  # restored
    assert all(kl < 1e-6 for kl in whole.values()), whole
    assert all(kl > 1e-4 for kl in part.values()), part  # a partial recompute is not exact
