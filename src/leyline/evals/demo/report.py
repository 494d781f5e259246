"""The demo's outputs: the per-turn table, the summary, the JSON and the PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leyline.evals.common.plots import save_figure

from .agreement import mean
from .episode import ARMS, TurnResult

ARM_TITLES = {"splice": "splice arm", "reprefill": "re-prefill arm"}


@dataclass(frozen=True, slots=True)
class ArmTotals:
    prefilled: int
    reused: int
    rotated: int
    latency_s: float
    splice_turns: int

    @classmethod
    def of(cls, turns: Sequence[TurnResult], arm: str) -> ArmTotals:
        records = [t.arms[arm].record for t in turns]
        return cls(
            prefilled=sum(r.prefilled_tokens or 0 for r in records),
            reused=sum(r.reused_tokens or 0 for r in records),
            rotated=sum(r.rotated_tokens or 0 for r in records),
            latency_s=sum(r.latency_s for r in records),
            splice_turns=sum(r.path == "splice" for r in records),
        )


def summary(turns: Sequence[TurnResult]) -> dict[str, Any]:
    totals = {arm: ArmTotals.of(turns, arm) for arm in ARMS}
    splice, reprefill = totals["splice"], totals["reprefill"]
    kls = [t.kl for t in turns if t.kl is not None]
    agree = [t.top1_agree for t in turns if t.top1_agree is not None]
    last = turns[-1].arms["reprefill"].record if turns else None
    return {
        "turns": len(turns),
        "context_tokens_last_turn": last.prompt_tokens if last else None,
        "arms": {arm: vars_of(totals[arm]) for arm in ARMS},
        "prefill_saved_fraction": 1 - splice.prefilled / reprefill.prefilled
        if reprefill.prefilled
        else None,
        "latency_ratio": reprefill.latency_s / splice.latency_s if splice.latency_s else None,
        "top1_agree": sum(agree),
        "top1_scored": len(agree),
        "kl_mean": mean(kls),
        "kl_max": max(kls) if kls else None,
        "text_agree": sum(t.text_agree for t in turns),
    }


def vars_of(totals: ArmTotals) -> dict[str, Any]:
    return {name: getattr(totals, name) for name in ArmTotals.__slots__}


def table(turns: Sequence[TurnResult]) -> str:
    head1 = (
        f"{'':4} {'scripted tool call':<28} {'policy edit':<11} | "
        f"{'splice arm':<39} | {'re-prefill arm':<31} | next token"
    )
    head2 = (
        f"{'turn':>4} {'':<28} {'':<11} | "
        f"{'path':<10} {'reused':>6} {'prefill':>7} {'rotated':>7} {'ms':>5} | "
        f"{'path':<10} {'reused':>6} {'prefill':>7} {'ms':>5} | {'top1':<4} {'KL':>7}"
    )
    rows = [head1, head2, "-" * len(head2)]
    for t in turns:
        s, r = t.arms["splice"].record, t.arms["reprefill"].record
        agree = "-" if t.top1_agree is None else ("yes" if t.top1_agree else "NO")
        kl = "-" if t.kl is None else f"{t.kl:.4f}"
        rows.append(
            f"{t.turn:>4} {t.call[:28]:<28} {', '.join(t.edits)[:11] or '-':<11} | "
            f"{s.path or '-':<10} {_n(s.reused_tokens):>6} {_n(s.prefilled_tokens):>7} "
            f"{_n(s.rotated_tokens):>7} {s.latency_s * 1000:>5.0f} | "
            f"{r.path or '-':<10} {_n(r.reused_tokens):>6} {_n(r.prefilled_tokens):>7} "
            f"{r.latency_s * 1000:>5.0f} | {agree:<4} {kl:>7}"
        )
    return "\n".join(rows)


def summary_text(facts: dict[str, Any], top_k: int) -> str:
    arms = facts["arms"]
    s, r = arms["splice"], arms["reprefill"]
    n = facts["turns"]
    lines = [
        f"Summary over {n} turns (context at the last turn: "
        f"{_n(facts['context_tokens_last_turn'])} tokens)",
        f"  {'':32} {'splice arm':>12} {'re-prefill arm':>15}",
        f"  {'prompt tokens prefilled':<32} {s['prefilled']:>12,} {r['prefilled']:>15,}"
        + _saved(facts["prefill_saved_fraction"]),
        f"  {'prompt tokens reused':<32} {s['reused']:>12,} {r['reused']:>15,}",
        f"  {'reused tokens rotated (RoPE)':<32} {s['rotated']:>12,} {r['rotated']:>15,}",
        f"  {'latency, all turns':<32} {s['latency_s']:>10.1f} s {r['latency_s']:>13.1f} s"
        + (
            f"   re-prefill / splice = {facts['latency_ratio']:.2f}x"
            if facts["latency_ratio"]
            else ""
        ),
        f"  {'latency, mean per turn':<32} {s['latency_s'] / n * 1000:>9.0f} ms "
        f"{r['latency_s'] / n * 1000:>12.0f} ms",
        f"  {'turns the server ran as splice':<32} {s['splice_turns']:>9}/{n} "
        f"{r['splice_turns']:>12}/{n}",
        "Next-token agreement, splice arm vs re-prefill arm (first generated token):",
    ]
    if facts["top1_scored"]:
        lines.append(
            f"  top-1 token the same in {facts['top1_agree']}/{facts['top1_scored']} turns; "
            f"KL(re-prefill || splice) mean {facts['kl_mean']:.4f}, max {facts['kl_max']:.4f} "
            f"nats (approximate: over the re-prefill arm's top-{top_k} tokens)"
        )
    else:
        lines.append("  not scored: the server sent no logprobs")
    lines.append(f"  generated text identical in {facts['text_agree']}/{n} turns")
    return "\n".join(lines)


def write_json(path: Path, header: dict[str, Any], turns: Sequence[TurnResult]) -> None:
    document = {**header, "summary": summary(turns), "turns": [t.to_json() for t in turns]}
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def plot(path: Path, turns: Sequence[TurnResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [t.turn for t in turns]
    fig, (tokens, latency, drift) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    width = 0.38
    for offset, arm in ((-width / 2, "splice"), (width / 2, "reprefill")):
        records = [t.arms[arm].record for t in turns]
        tokens.bar(
            [v + offset for v in x],
            [r.prefilled_tokens or 0 for r in records],
            width,
            label=ARM_TITLES[arm],
        )
        latency.plot(x, [r.latency_s * 1000 for r in records], marker="o", label=ARM_TITLES[arm])
    tokens.set_ylabel("prompt tokens prefilled")
    tokens.legend()
    latency.set_ylabel("latency per turn (ms)")
    latency.set_ylim(bottom=0)
    latency.legend()
    kls = [t.kl or 0.0 for t in turns]
    colors = ["tab:green" if t.top1_agree is not False else "tab:red" for t in turns]
    drift.bar(x, kls, color=colors)
    drift.set_ylabel("KL of next token (nats)")
    drift.set_xlabel("turn (green: same top-1 token in both arms, red: different)")
    drift.set_xticks(x)
    fig.suptitle(title)
    save_figure(fig, path)


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _saved(fraction: float | None) -> str:
    if fraction is None:
        return ""
    return f"   splice prefilled {fraction:.0%} fewer"
