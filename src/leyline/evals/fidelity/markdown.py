"""``report.md``: the tables, built from the same data that goes into ``report.json``."""

from __future__ import annotations

from typing import Any

from leyline.evals.common import markdown_table

from .drift import ARMS
from .summary import KL_FIELDS

ModelData = dict[str, Any]

_AGREEMENT_ROWS = (
    ("splice = full context", "splice_eq_full"),
    ("splice = re-prefill", "splice_eq_reprefill"),
    ("full context = re-prefill", "full_eq_reprefill"),
    ("unrotated splice = re-prefill (control)", "control_eq_reprefill"),
)
_KL_NAMES = {
    "kl_splice_vs_full": "KL(full context ‖ splice)",
    "kl_splice_vs_reprefill": "KL(re-prefill ‖ splice)",
    "kl_reprefill_vs_full": "KL(full context ‖ re-prefill)",
    "kl_control_vs_reprefill": "KL(re-prefill ‖ unrotated splice), control",
}


def _pct(n: int, total: int) -> str:
    return f"{n}/{total} ({100 * n / total:.1f}%)" if total else "0/0"


def overview(models: dict[str, ModelData]) -> str:
    rows = []
    for data in models.values():
        a = data["agreement"]
        c, d = a["counts"], a["divergent"]
        drift = data["drift"]["checkpoints"]["chain"]
        last = max(drift[ARMS[0]])
        rows.append(
            [
                data["label"],
                c["prompts"],
                a["kl"]["kl_splice_vs_full"]["median"],
                a["kl"]["kl_splice_vs_reprefill"]["median"],
                _pct(c["splice_eq_full"], c["prompts"]),
                _pct(c["splice_eq_reprefill"], c["prompts"]),
                f"{d['splice_follows_full']} / {d['splice_follows_reprefill']} / "
                f"{d['splice_follows_neither']} of {d['prompts']}",
                data["key_error"]["worst"],
                f"{drift[ARMS[0]][last]:.2e} / {drift[ARMS[1]][last]:.2e} (k={last})",
            ]
        )
    header = [
        "model",
        "prompts",
        "median KL splice vs full",
        "median KL splice vs re-prefill",
        "argmax splice = full",
        "argmax splice = re-prefill",
        "full ≠ re-prefill: splice follows full / re-prefill / neither",
        "worst key error (fp32)",
        "bf16 drift, fp32 / bf16 rotation",
    ]
    return markdown_table(header, rows)


def model_sections(data: ModelData) -> list[tuple[str, str]]:
    """(heading, body) pairs for one model; every heading carries the model's label."""
    label = data["label"]
    return [
        (
            f"{label}: agreement over {data['agreement']['counts']['prompts']} prompts",
            _agreement(data),
        ),
        (f"{label}: prompts where full context and re-prefill disagree", _divergent(data)),
        (f"{label}: key error per layer", _keys(data)),
        (f"{label}: drift over repeated splices", _drift(data)),
    ]


def _agreement(data: ModelData) -> str:
    a = data["agreement"]
    c = a["counts"]
    n = c["prompts"]
    agree = markdown_table(
        ["next-token argmax", "agree"], [[name, _pct(c[key], n)] for name, key in _AGREEMENT_ROWS]
    )
    kl = markdown_table(
        ["measure (nats)", "mean", "median", "p95", "max"],
        [[_KL_NAMES[f], *a["kl"][f].values()] for f in KL_FIELDS],
    )
    kinds = markdown_table(
        [
            "question about",
            "prompts",
            "splice = full",
            "splice = re-prefill",
            "full = re-prefill",
            "median KL vs full",
            "median KL vs re-prefill",
        ],
        [
            [
                k,
                v["prompts"],
                v["splice_eq_full"],
                v["splice_eq_reprefill"],
                v["full_eq_reprefill"],
                v["kl_splice_vs_full_median"],
                v["kl_splice_vs_reprefill_median"],
            ]
            for k, v in a["by_kind"].items()
        ],
    )
    parts = [
        f"Layout `{data['layout']}`, RoPE `{data['rope_type']}`, {data['seconds']:.0f} s. "
        f"Splices that fell back to re-prefill: {c['fallbacks']}.",
        agree,
        kl,
        "By what the last sentence asks about (`removed`: a fact only the replaced span "
        "held; `kept`: a fact downstream of it; `continue`: nothing in particular):",
        kinds,
    ]
    if a["answers"]:
        parts += [
            "How often each arm's argmax is the first token of the asked-for fact:",
            markdown_table(
                ["question about", "prompts", "full context", "re-prefill", "splice"],
                [
                    [k, v["prompts"], v["full"], v["reprefill"], v["splice"]]
                    for k, v in a["answers"].items()
                ],
            ),
        ]
    return "\n\n".join(parts)


def _divergent(data: ModelData) -> str:
    d = data["agreement"]["divergent"]
    body = [
        f"{d['prompts']} prompts: the splice's argmax equals full context's in "
        f"{d['splice_follows_full']}, re-prefill's in {d['splice_follows_reprefill']}, "
        f"neither in {d['splice_follows_neither']}. By kind: `{d['by_kind']}`."
    ]
    examples = [r for r in data["records"] if r["argmax_full"] != r["argmax_reprefill"]][:12]
    if examples:
        rows = []
        for r in examples:
            rows.append(
                [
                    r["id"],
                    r["kind"],
                    *(_token(r, arm) for arm in ("full", "reprefill", "splice")),
                    r["follows"],
                    r["kl_splice_vs_full"],
                    r["kl_splice_vs_reprefill"],
                ]
            )
        body.append(
            markdown_table(
                [
                    "prompt",
                    "kind",
                    "full context",
                    "re-prefill",
                    "splice",
                    "follows",
                    "KL vs full",
                    "KL vs re-prefill",
                ],
                rows,
            )
        )
    return "\n\n".join(body)


def _token(record: dict[str, Any], arm: str) -> str:
    """The arm's argmax as text (tokenizer models) or as an id."""
    if "text" in record:
        return repr(record["text"][arm])
    return str(record[f"argmax_{arm}"])


def _keys(data: ModelData) -> str:
    k = data["key_error"]
    rows = [
        [
            i,
            k["rotated_max"][i],
            k["rotated_median"][i],
            k["unrotated_min"][i],
            k["prefill_vs_reference_max"][i],
        ]
        for i in range(len(k["rotated_max"]))
    ]
    return "\n\n".join(
        [
            f"Prompts {k['prompts']} (deltas {k['deltas']}). Worst layer: {k['worst']:.2e}. "
            f"Values / latents outside the rope band bitwise unchanged: {k['rest_bitwise']}.",
            markdown_table(
                [
                    "layer",
                    "rotated: max",
                    "rotated: median",
                    "not rotated: min",
                    "engine prefill vs reference run",
                ],
                rows,
            ),
        ]
    )


def _drift(data: ModelData) -> str:
    d = data["drift"]
    parts = [f"{d['elements']} numbers of real rope band (all layers) rotated again and again."]
    for pattern, arms in d["checkpoints"].items():
        counts = sorted(next(iter(arms.values())))
        rows = [[arm, *[arms[arm][c] for c in counts], d["slopes"][pattern][arm]] for arm in arms]
        parts.append(f"`{pattern}` deltas:")
        parts.append(markdown_table(["arm", *[f"k={c}" for c in counts], "log-log slope"], rows))
    return "\n\n".join(parts)
