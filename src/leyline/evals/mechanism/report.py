"""The mechanism eval's tables (printed and in report.md) and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leyline.evals.common import markdown_table
from leyline.evals.common.plots import save_figure

from .replay import ARMS
from .stats import ratio

QUEUE_NOTE = (
    "`leyline serve` runs one forward at a time: its scheduler batches the decode steps of "
    "concurrent generations and slices edits and prefills at prefill chunks, so a short "
    "request (a splice) waits for a chunk, not for a whole long re-prefill queued before "
    "it. Queued and service times are the server's own (`leyline.timing`)."
)
EXTERNAL_NOTE = (
    "An external server (--base-url): its own scheduler decides how the two arms' requests "
    "share the hardware, and its backend's costs set the latency ratios (e.g. SGLang on "
    "CPU with torch_native attention and a 135M model: per-request overheads are a large "
    "share of each request, so the splice's saving in prefilled tokens shows more in the "
    "hit rates than in latency)."
)
SHARED_NOTE = "Both arms run against the same server, interleaved turn by turn: one queue."
APART_NOTE = (
    "Arms apart (--arms-apart): at each level the splice arm's clients ran alone, then the "
    "re-prefill arm's, so each arm queues behind its own work only; the throughput per arm "
    "is in report.json (`throughput_rps_by_arm`)."
)


COUNTER_NOTE = (
    "--server-counter implies --arms-apart: a counter of the whole server counts one arm's "
    "work only while that arm's clients run alone."
)
COUNTER_TEXT = (
    "Growth of the server's own counter (its /metrics, summed over the matching series) "
    "while each arm's clients ran alone, next to the ratio of the tokens the Leyline "
    "report says were prefilled: what the server counts and the report does not (e.g. "
    "vLLM's filler up to block boundaries) shows as a difference between the two ratios."
)


def concurrency_note(base_url: str | None, arms_apart: bool = False, counter: bool = False) -> str:
    note = EXTERNAL_NOTE if base_url else QUEUE_NOTE
    note = f"{note} {APART_NOTE if arms_apart else SHARED_NOTE}"
    return f"{note} {COUNTER_NOTE}" if counter else note


def counter_table(table: dict[str, Any], facts: dict[str, Any], selector: str) -> str:
    """The server counter's growth by level and arm, its splice / re-prefill ratio next to
    the report's own prefilled-token ratio, and all levels together."""
    header = ["c", "server counter", "splice", "re-prefill", "splice/re-prefill"]
    header.append("prefilled splice/re-prefill (report)")
    keys = ("server_counter", "prefilled_tokens")
    total = {arm: {k: facts[k][arm] for k in keys} for arm in ARMS}
    rows_in = [(c, row["splice"], row["reprefill"]) for c, row in table.items()]
    rows_in.append(("all", total["splice"], total["reprefill"]))
    rows = []
    for c, splice, reprefill in rows_in:
        if "server_counter" in splice:
            grown = (splice["server_counter"], reprefill["server_counter"])
            prefilled = (splice["prefilled_tokens"], reprefill["prefilled_tokens"])
            ratios = [f"{ratio(*grown):.2f}", f"{ratio(*prefilled):.2f}"]
            rows.append([c, f"`{selector}`", *map(_count, grown), *ratios])
    return markdown_table(header, rows)


def _count(value: float) -> str:
    """A counter's value: an integer where it is one (token counts), else as read."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def latency_table(table: dict[str, Any]) -> str:
    header = ["c", "arm", "requests", "e2e p50 ms", "e2e p90 ms", "e2e mean ms"]
    header += ["TTFT p50 ms", "TTFT p90 ms"]
    header += ["queued p50 ms", "service p50 ms", "decode p50 ms"]
    header += ["hit rate", "reuse of reusable", "prefilled", "rotated", "ran as splice"]
    rows: list[list[Any]] = []
    for level, row in table.items():
        for arm in ARMS:
            a = row[arm]
            keys = ("e2e_p50", "e2e_p90", "e2e_mean", "ttft_p50", "ttft_p90")
            times = [round(a[f"{k}_ms"]) for k in keys]
            times += [_ms(a.get(f"{k}_p50_ms")) for k in ("queued", "service", "decode")]
            counts = [a["prefilled_tokens"], a["rotated_tokens"], a["splice_paths"]]
            rates = [f"{a['hit_rate']:.1%}", f"{a['reuse_of_reusable']:.1%}"]
            rows.append([level, arm, a["requests"], *times, *rates, *counts])
    return markdown_table(header, rows)


def _ms(value: float | None) -> str:
    """A time in ms, or '-' where the server reported none (NaN)."""
    return "-" if value is None or value != value else str(round(value))


def ratio_table(table: dict[str, Any]) -> str:
    header = ["c", "e2e p50 re-prefill/splice", "TTFT p50 re-prefill/splice", "hit rate gain"]
    header += ["throughput req/s", "e2e mean ms, all requests"]
    header.append("first-token argmax agree (spliced turns)")
    rows = []
    for level, row in table.items():
        agree = row["agreement"]
        rows.append(
            [
                level,
                f"{row['ratio_e2e_p50_ms']:.2f}x",
                f"{row['ratio_ttft_p50_ms']:.2f}x",
                f"{row['hit_rate_gain_pp']:+.1f} pp",
                f"{row.get('throughput_rps', float('nan')):.2f}",
                _ms(row.get("e2e_mean_all_ms")),
                f"{agree['agree']}/{agree['pairs']} ({agree['spliced_agree']}/"
                f"{agree['spliced_pairs']})",
            ]
        )
    return markdown_table(header, rows)


def overhead_table(overhead: dict[str, Any]) -> str:
    rows = [
        [name, o["http_p50_ms"], o["inproc_p50_ms"], o["overhead_p50_ms"], overhead["what"][name]]
        for name, o in ((n, overhead[n]) for n in overhead["what"])
    ]
    return markdown_table(["call", "HTTP p50 ms", "in-process p50 ms", "overhead ms", "what"], rows)


def pool_table(pool: list[dict[str, Any]]) -> str:
    rows = [[t["source"], t["count"], t["turns"], t["chars"]] for t in pool]
    return markdown_table(["source", "trajectories", "tool turns", "output chars"], rows)


def plot_latency(table: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    levels = [int(k) for k in table]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arm, color in zip(ARMS, ("tab:blue", "tab:orange"), strict=True):
        for key, style in (("e2e_p50_ms", "-o"), ("ttft_p50_ms", "--x")):
            ys = [table[str(c)][arm][key] for c in levels]
            axes[0].plot(levels, ys, style, color=color, label=f"{arm} {key.split('_')[0]} p50")
        hits = [100 * table[str(c)][arm]["hit_rate"] for c in levels]
        axes[1].plot(levels, hits, "-o", color=color, label=arm)
    axes[0].set(xlabel="concurrent clients", ylabel="ms", title="p50 latency")
    axes[1].set(xlabel="concurrent clients", ylabel="%", title="replay cache-hit rate")
    axes[1].set_ylim(0, 100)
    for ax in axes:
        ax.set_xticks(levels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)
