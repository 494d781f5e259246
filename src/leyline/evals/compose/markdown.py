"""The report's Markdown sections, from the summary alone."""

from __future__ import annotations

from typing import Any

from leyline.evals.common import markdown_table

from .arms import FULL, NO_SKILL

NOT_MEASURED = """\
- The skill's one-time compile (its prefill from position 0) is not in any TTFT: a skill is
  compiled once and composed into many sessions. Its time is in the memory table.
"""

ARMS_TEXT = """\
- `full`: the reference: the prefix prefilled, then skill + question prefilled on its KV
  (the same computation as a prefill of the whole context from scratch: attention is
  causal, and the engine prefills in 512-token chunks either way).
- `compose_kK`: `SessionCache.compose(skill, len(prefix), seam_tokens=K)` on the prefilled
  prefix (the skill's KV compiled once from position 0, keys rotated by `at`, its first K
  tokens prefilled against the prefix), then the question prefilled fresh.
- `compose_kK_devP`: the same compose with selective recompute (`recompute_ratio = P/100`,
  the server's `{"mode": "deviation"}`): the block's copied tokens are run in context
  through the first five layers, and the P% whose KV there deviates most from the copy are
  recomputed through every layer (definition: `src/leyline/engine/edits/recompute.py`).
- `compose_kK_askP`: the same share of the block recomputed the same way, chosen instead
  by the attention the question's queries give each block token in the seam-only compose
  (summed over layers and heads): recompute what the question needs, the server's
  `{"mode": "attention"}` (definition: `src/leyline/engine/edits/attention_recompute.py`). It needs
  the question in the request that composes and one extra forward of it.
- `anchored_kK`: the plain compose of the skill compiled after an anchor (the run's
  `anchor` in the configuration; by default what the chat template puts before a user
  message's content) whose KV is dropped, so the block does not start a sequence of its
  own: `compile_skill(..., anchor=...)`. `anchored_kK_askP`: question-aware recompute on
  that skill.
- `norot_kK` (control): the same compose of a skill whose keys were pre-rotated by `-at`, so
  COMPOSE's rotation by `at` brings them back to the positions they were computed at: the
  skill's KV copied without rotation, seam repaired as usual.
- `no_skill`: prefix + question only: how much the next token depends on the skill.

Metrics are on the next-token logits after the question, against `full`: KL(full || arm),
raw and centred (mean-subtracted) cosine, argmax agreement, and the probability the arm
gives the designated answer token (the routed team for policy, the passage's fact, the
right tool name's first token). TTFT is wall time from the cached prefix to those logits;
"cold" adds the prefix's own prefill to both arms. Each item is one interleaved repeat
(even items time `full` first, odd ones last); figures are medians over all kinds' items.
"""


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def targets_table(rows: list[dict[str, Any]]) -> str:
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    body = [
        [r["target"], f"{r['op']} {r['bound']:g}", _fmt(r["measured"]), verdict[r["met"]]]
        for r in rows
    ]
    return markdown_table(["target", "bound", "measured", "verdict"], body)


def fidelity_table(cells: list[dict[str, Any]], kind: str, arms: list[str]) -> str:
    rows = []
    for cell in (c for c in cells if c["kind"] == kind):
        for arm in arms:
            f = cell["arms"][arm]
            agree = f["argmax_agrees"]
            top = f["answer_is_argmax"]
            rows.append(
                [
                    cell["tokens"],
                    arm,
                    _fmt(f["kl"]["mean"]),
                    _fmt(f["kl"]["median"]),
                    _fmt(f["kl"]["max"]),
                    f"{f['cosine_mean']:.6f}",
                    f"{f['centred_cosine']['mean']:.5f} ({f['centred_cosine']['min']:.5f})",
                    f"{agree['count']}/{agree['n']}",
                    _fmt(f["p_answer_mean"], 3),
                    "-" if top is None else f"{top['count']}/{top['n']}",
                ]
            )
    header = [
        "skill tokens", "arm", "KL mean", "KL median", "KL max", "cosine", "centred cos (min)",
        "argmax = full", "P(answer)", "answer = argmax",
    ]  # fmt: skip
    return markdown_table(header, rows)


def ttft_table(rows: list[dict[str, Any]], seams: list[int]) -> str:
    body = []
    recompute = list(rows[0].get("recompute", {})) if rows else []
    for r in rows:
        extra = r.get("recompute", {})
        line = [
            r["requested"],
            f"{r['tokens_mean']:.0f}",
            r["repeats"],
            f"{r['full']['cached']:.3f}",
        ]
        arms = [r["compose"][str(s)] for s in seams] + [extra[a] for a in recompute]
        line += [f"{m['cached']:.3f} ({m['speedup_cached']:.1f}x)" for m in arms]
        line += [f"{r['full']['cold']:.3f}"]
        line += [f"{m['cold']:.3f} ({m['speedup_cold']:.1f}x)" for m in arms]
        body.append(line)
    names = [f"K={s}" for s in seams] + recompute
    header = ["length", "skill tokens", "repeats", "full, cached (s)"]
    header += [f"{n}, cached" for n in names] + ["full, cold (s)"]
    header += [f"{n}, cold" for n in names]
    return markdown_table(header, body)


def p_answer_table(rows: list[dict[str, Any]], arms: list[str]) -> str:
    body = []
    for r in rows:
        cells = []
        for arm in arms:
            f = r["arms"][arm]
            kept = "" if f["of_full"] is None or arm == FULL else f" ({f['of_full']:.2f}x)"
            cells.append(_fmt(f["mean"], 3) + kept)
        body.append([r["kind"], r["tokens"], *cells])
    return markdown_table(["kind", "skill tokens", *arms], body)


def memory_table(rows: list[dict[str, Any]]) -> str:
    body = [
        [
            r["kind"],
            r["tokens"],
            f"{r['nbytes'] / 2**20:.1f}",
            f"{r['nbytes'] / r['tokens'] / 1024:.1f}",
            f"{r['compile_seconds']:.2f}",
        ]
        for r in rows
    ]
    return markdown_table(["kind", "skill tokens", "KV MiB", "KiB / token", "compile (s)"], body)


def sections(summary: dict[str, Any], arms: list[str], seams: list[int]) -> list[tuple[str, str]]:
    out = [("Targets (issue 13, K = 16)", targets_table(summary["targets"]))]
    if summary.get("anchored_targets"):
        anchored = targets_table(summary["anchored_targets"])
        out.append(("The same targets for the anchored compile", anchored))
    for arm, rows in summary.get("recompute_targets", {}).items():
        out.append((f"The same targets for `{arm}`", targets_table(rows)))
    out.append(("Arms", ARMS_TEXT))
    shown = [FULL, *[a for a in arms if a not in (FULL, NO_SKILL)], NO_SKILL]
    for kind in dict.fromkeys(c["kind"] for c in summary["cells"]):
        note = (
            "\n\nKL, cosines and argmax are against `full` (whose row shows its own answer "
            "probability); P(answer) is the mean over items."
        )
        out.append((f"Fidelity: {kind}", fidelity_table(summary["cells"], kind, shown) + note))
    if "p_answer" in summary:
        out.append(
            (
                "Answer-token probability (mean over items; its ratio to full's in brackets)",
                p_answer_table(summary["p_answer"], shown),
            )
        )
    out.append(
        ("TTFT (median seconds; speedup vs full in brackets)", ttft_table(summary["ttft"], seams))
    )
    out.append(("Memory: skill KV", memory_table(summary["memory"])))
    out.append(("Not measured", NOT_MEASURED))
    return out
