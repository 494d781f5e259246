"""The error oracles: exact KV substituted by layer or by token, on a tiny MLA model."""

from __future__ import annotations

import pytest
import torch

from leyline.evals.compose.error_oracle import (
    COMPOSED,
    main,
    oracle_kls,
    substituted,
    table,
    token_error,
)

from ._compose_scene import tiny_scene


def _cache(seed: int, layers: int = 3, tokens: int = 6) -> tuple[tuple[torch.Tensor, ...], ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(
        (torch.randn(1, 2, tokens, 4, generator=g), torch.randn(1, tokens, 3, generator=g))
        for _ in range(layers)
    )


def test_substitution_takes_the_exact_rows_in_the_named_layers_only() -> None:
    mine, exact = _cache(0), _cache(1)
    before = [t.clone() for layer in mine for t in layer]
    positions = torch.tensor([1, 4])
    out = substituted(mine, exact, [1], positions)
    after = [t for layer in mine for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # untouched
    assert out[0] is mine[0] and out[2] is mine[2]
    for got, ours, theirs in zip(out[1], mine[1], exact[1], strict=True):
        assert torch.equal(got[..., positions, :], theirs[..., positions, :])
        keep = torch.tensor([0, 2, 3, 5])
        assert torch.equal(got[..., keep, :], ours[..., keep, :])


def test_token_error_is_the_squared_distance_per_position() -> None:
    mine, exact = _cache(0), _cache(0)
    exact[2][1][0, 3, :] += 2.0  # three entries off by 2 at position 3 of layer 2's values
    error = token_error(mine, exact, torch.tensor([2, 3, 5]))
    assert error.tolist() == pytest.approx([0.0, 12.0, 0.0])


def test_the_table_is_the_mean_per_cell() -> None:
    rows = [
        ("passage", 500, 0, {COMPOSED: 0.06, "layers 5-30": 0.001}),
        ("passage", 500, 1, {COMPOSED: 0.04, "layers 5-30": 0.003}),
        ("tools", 400, 0, {COMPOSED: 0.07, "layers 5-30": 0.002}),
    ]
    lines = table(rows).splitlines()
    assert lines[0] == "| variant | passage, 500 | tools, 400 |"
    assert lines[2] == "| composed | 0.0500 | 0.0700 |"
    assert lines[3] == "| layers 5-30 | 0.0020 | 0.0020 |"


@torch.inference_mode()
def test_the_whole_exact_block_matches_the_full_prefill_and_parts_do_not() -> None:
    scene = tiny_scene(layers=4)
    engine, prefix, skill, question = scene.engine, scene.prefix, scene.skill, scene.question
    kls = oracle_kls(
        engine, prefix, skill, question, seam=4, layer_ranges=[(0, 4), (0, 1), (2, 4)],
        ratios=[1.0, 0.2],
    )  # fmt: skip
    assert kls[COMPOSED] > 1e-4  # the copied block never saw the prefix
    assert kls["layers 0-4"] < 1e-6 and kls["error top 100%"] < 1e-6, kls
    assert kls["random 100%"] < 1e-6
    for partial in ("layers 0-1", "layers 2-4", "error top 20%", "random 20%"):
        assert kls[partial] > 1e-6, (partial, kls)
    with pytest.raises(ValueError, match="past the model's 4 layers"):
        oracle_kls(engine, prefix, skill, question, 4, [(0, 5)], [])


def test_the_cli_refuses_bad_ranges_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--layer-ranges", "5-5"], ["--layer-ranges", "3"], ["--ratios", "0,0.5"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "use layer ranges like 0-5,5-30" in capsys.readouterr().err
