"""Run the compose eval: compile each skill, run every item through every arm, report."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from leyline.engine.edits.skills import Skill, compile_skill
from leyline.engine.engine import Engine
from leyline.evals.common import Report, progress, results_dir
from leyline.evals.common.engine import rotating_engine, run_footer

from .anchor import NONE, TEMPLATE, anchor_text
from .arms import (
    FULL,
    NO_SKILL,
    ArmSet,
    ItemResult,
    anchored_arm,
    compose_arm,
    control_arm,
    run_item,
)
from .cases import CONTEXT_RESERVE, Item, context_positions, fit_case
from .markdown import sections
from .plots import plot_kl_by_seam, plot_ttft
from .summary import cells, kl_by_seam, p_answer, targets, ttft
from .texts import Kind


@dataclass(frozen=True, slots=True)
class ComposeOptions:
    model: str
    kinds: tuple[Kind, ...]
    lengths: tuple[int, ...]
    """Requested skill lengths in tokens (capped by the model's context)."""
    seams: tuple[int, ...]
    control_seam: int
    items: int
    """Decision items per kind and length (each is also one TTFT repeat)."""
    seed: int
    out: Path | None
    fast: bool = False
    progress: bool = True
    recompute_seam: int = 16
    """K of the selective-recompute arms."""
    ratios: tuple[float, ...] = ()
    """Deviation ratios: one ``compose_k{recompute_seam}_dev{P}`` arm each."""
    ask_ratios: tuple[float, ...] = ()
    """Question-aware ratios: one ``compose_k{recompute_seam}_ask{P}`` arm each."""
    prefix_tokens: int = 0
    """Each item's prefix grown by earlier conversation to at least this many tokens (0:
    3-5 exchanges, about 170-310 tokens on SmolLM2): how deep the skill lands."""
    anchor: str | None = TEMPLATE
    """The ``anchored_k{recompute_seam}`` arm's anchor (``anchor.anchor_text``); ``none``
    or None: no such arm."""

    @property
    def arm_set(self) -> ArmSet:
        return ArmSet(
            self.seams, self.control_seam, self.recompute_seam, self.ratios, self.ask_ratios,
            anchored=self.anchor not in (None, NONE),
        )  # fmt: skip

    @property
    def arms(self) -> list[str]:
        return [
            FULL,
            *(compose_arm(s) for s in self.seams),
            *self.arm_set.recompute_arms(),
            control_arm(self.control_seam),
            NO_SKILL,
        ]


def skill_budget(max_session_tokens: int | None, options: ComposeOptions) -> int:
    """The most tokens a skill may take: the model's context less the prefix's room and the
    question's. Raises ``ValueError`` when that leaves no room for the shortest length."""
    limit = context_positions(max_session_tokens)
    budget = limit - CONTEXT_RESERVE - options.prefix_tokens
    if budget < min(options.lengths):
        raise ValueError(
            f"--prefix-tokens {options.prefix_tokens} leaves no room for a "
            f"{min(options.lengths)}-token skill in {limit} positions"
        )
    return budget


def _work(
    engine: Engine, options: ComposeOptions, memory: list[dict[str, Any]], anchor: Sequence[int]
) -> Iterator[tuple[Skill, Skill | None, Item]]:
    """Each (skill, anchored skill or None, item) in order; a skill is compiled (and its
    memory noted) on first use, after ``anchor`` too when there is one."""
    for requested in options.lengths:
        for kind in options.kinds:
            case, items = fit_case(
                kind, requested, engine.encode, options.seed, options.items,
                max_session_tokens=engine.limits.max_session_tokens,
                prefix_tokens=options.prefix_tokens,
            )  # fmt: skip
            t0 = time.perf_counter()
            skill = compile_skill(
                engine, case.tokens, skill_id=f"{kind}-{requested}", tenant="eval"
            )
            memory.append(
                {
                    "kind": kind,
                    "requested": requested,
                    "tokens": len(skill),
                    "units": case.units,
                    "nbytes": skill.nbytes,
                    "compile_seconds": time.perf_counter() - t0,
                }
            )
            anchored = None
            if anchor:
                t0 = time.perf_counter()
                anchored = compile_skill(
                    engine, case.tokens, skill_id=f"{kind}-{requested}-anchored",
                    tenant="eval", anchor=anchor,
                )  # fmt: skip
                memory[-1]["anchored_compile_seconds"] = time.perf_counter() - t0
            for item in items:
                yield skill, anchored, item
            del skill, anchored


def _record(result: ItemResult, engine: Engine) -> dict[str, Any]:
    item = result.item
    return {
        "kind": item.kind,
        "requested": item.requested,
        "skill_tokens": result.skill_length,
        "index": item.index,
        "unit": item.unit,
        "depth": item.depth,
        "prefix_tokens": len(item.prefix),
        "question_tokens": len(item.question),
        "answer": item.answer,
        "answer_token": item.answer_token,
        "answer_token_text": None
        if item.answer_token is None
        else engine.decode([item.answer_token]),
        "prefix_seconds": result.prefix_seconds,
        "seconds": result.seconds,
        "paths": result.paths,
        "arms": {arm: asdict(a) for arm, a in result.agreement.items()},
    }


@torch.inference_mode()
def run_compose_eval(options: ComposeOptions) -> Path:
    t0 = time.perf_counter()
    engine = rotating_engine(options.model, "skills")
    skill_budget(engine.limits.max_session_tokens, options)  # refuse before writing anything
    folder = results_dir("compose", options.out)
    engine.forward((), engine.encode("Warm up the allocator and the kernels."))
    memory: list[dict[str, Any]] = []
    total = len(options.lengths) * len(options.kinds) * options.items
    anchor = anchor_text(options.anchor, engine.tokenizer)
    anchor_ids = tuple(engine.encode(anchor)) if anchor else ()
    results = [
        run_item(engine, skill, item, options.arm_set, anchored)
        for skill, anchored, item in progress(
            _work(engine, options, memory, anchor_ids),
            desc="compose items",
            total=total,
            enabled=options.progress,
        )
    ]
    cell_list = cells(results, options.arms)
    ttft_rows = ttft(results, options.seams, options.arm_set)
    summary = {
        "cells": cell_list,
        "kl_by_seam": kl_by_seam(cell_list, options.seams, options.arm_set),
        "p_answer": p_answer(cell_list, options.arms),
        "ttft": ttft_rows,
        "memory": memory,
        "targets": targets(cell_list, ttft_rows, options.control_seam),
        "anchored_targets": targets(
            cell_list, ttft_rows, options.control_seam, anchored_arm(options.recompute_seam)
        )
        if options.arm_set.anchored
        else [],
        # The same targets for each selective-recompute arm (deviation and attention).
        "recompute_targets": {
            name: targets(cell_list, ttft_rows, options.control_seam, name)
            for name, _ in options.arm_set.deviation_arms() + options.arm_set.ask_arms()
        },
        "all_finite": all(a.finite for r in results for a in r.agreement.values()),
        "fallbacks": sum(p != "splice" for r in results for p in r.paths.values()),
    }
    config = {
        "model": engine.loaded.label,
        "random_weights": engine.loaded.random_weights,
        "kinds": ",".join(options.kinds),
        "lengths": ",".join(map(str, options.lengths)),
        "seams": ",".join(map(str, options.seams)),
        "control_seam": options.control_seam,
        "recompute_seam": options.recompute_seam,
        "recompute_selection_layer": engine.recompute_selection_layer,
        "recompute_ratios": ",".join(f"{r:g}" for r in options.ratios),
        "ask_ratios": ",".join(f"{r:g}" for r in options.ask_ratios),
        "anchor": anchor,
        "anchor_tokens": len(anchor_ids),
        "items_per_kind_and_length": options.items,
        "prefix_tokens": options.prefix_tokens,
        **run_footer(options.seed, options.fast, t0),
    }
    report = Report("compose", "Compose: precomputed skills vs a full prefill", config, folder)
    report.data = {"summary": summary, "records": [_record(r, engine) for r in results]}
    for heading, body in sections(summary, options.arms, list(options.seams)):
        report.section(heading, body)
    report.plots = {
        "ttft.png": lambda p: plot_ttft(summary, p),
        "kl_by_k.png": lambda p: plot_kl_by_seam(summary, p),
    }
    report.write()
    return folder
