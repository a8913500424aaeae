"""The "Beyond two machines" section of EXPERIMENTS.md (bench/experiments/scale.py's runs).

A piece of the plan not trained yet renders as "not run yet".
"""

# Markdown table rows are long lines by nature.

from __future__ import annotations

import numpy as np

from bench.experiments.lm_tables import across
from bench.experiments.lm_tables import cell
from bench.experiments.lm_tables import gap
from bench.experiments.lm_tables import score
from configs import default

__all__ = ["mean", "score", "section"]

# The scaling-law study (arXiv 2503.09799, Table 4): DiLoCo's final loss over
# data-parallel's at 2 / 4 / 8 replicas, 35M parameters (H=30, outer Nesterov 0.9, the
# outer learning rate tuned per replica count).
FIELD_35M = {2: 0.7, 4: 2.0, 8: 3.9}
GOALS = {4: 1.0, 8: 2.0}
COMMAND = "python -m bench.experiments scale --keep-published"


def mean(records) -> float:
    """The mean final validation bits per byte of `records` (one per seed)."""
    return float(np.mean([score(r) for r in records]))


#: The levers whose winner can go to 8 machines (scale.py's keys), as the table names them.
LEVERS = {
    "muon momentum best": "Muon inner, its outer momentum re-swept",
    "muon h5 best": "Muon inner at H=5",
    "muon beta best": "Muon's own momentum",
}


def _bytes(records) -> str:
    if not records:
        return "-"
    return f"{across(records[0]):,.0f}"


def _fraction(records, base) -> str:
    if not records or not base:
        return "-"
    sent, full = across(records[0]), across(base[0])
    return f"1/{full / sent:.0f}" if sent else "0"


def _seeds(records) -> str:
    n = len(records or ())
    return f"{n} seed" + ("" if n == 1 else "s")


def _setting(records) -> str:
    if not records:
        return "-"
    c = default.get_config().to_dict() | records[0]["config"]  # records hold changed fields
    text = f"H={c.get('local_steps')}, outer {c.get('outer_lr'):g} / {c.get('outer_momentum'):g}"
    if c.get("optimizer") == "muon":
        text += f", Muon {c.get('learning_rate'):g}"
    return text


def _sweep(title: str, sweep: dict | None, fields: tuple[str, ...]) -> list[str]:
    if not sweep:
        return [f"{title}: not run yet.", ""]
    lines = [f"{title} (seed 0, final validation bits per byte):", ""]
    lines += ["| " + " | ".join(fields) + " | bits per byte |", "|" + "---|" * (len(fields) + 1)]
    ranked = sorted(sweep.items(), key=lambda kv: score(kv[1]) if kv[1] else np.inf)
    for values, record in ranked:
        result = "not run yet" if record is None else f"{score(record):.4f}"
        if record is not None and record.get("sweep_winner"):
            result = f"**{result}** (winner)"
        lines.append("| " + " | ".join(f"{v:g}" for v in values) + f" | {result} |")
    return lines + [""]


def _kept(out: dict, key: str, field: str = "outer lr") -> str | None:
    """A Muon sweep's outcome (`out[key]`) when its winner is the recipe's own value."""
    sweep = out.get(key)
    if sweep and all(sweep.values()):
        return f"the recipe's {field} won the sweep (below)"
    return None


def _batch_kept(out: dict) -> str | None:
    """The batch sweep's outcome when DiLoCo's best batch is the recipe's own."""
    factors = out.get("batch factors")
    if factors and all(out.get(f"batch x{f:g} diloco") for f in factors):
        return "the recipe's batch won the sweep (below)"
    return None


def _fields(record: dict) -> str:
    """The re-tuned fields of a run's `record` as its config holds them ("H" for H)."""
    config = record.get("config", {})
    fields = ("learning_rate", "outer_lr", "outer_momentum", "local_steps")
    return ", ".join(
        f"{'H' if f == 'local_steps' else f}={config[f]:g}" for f in fields if f in config
    )


_RETUNE_FROM = {
    "together": "the winners together",
    "local_steps": "H alone",
    "outer_lr": "the outer lr alone",
    "outer_momentum": "the outer momentum alone",
    "learning_rate": "Muon's rate alone",
}


def _retune_kept(out: dict) -> str | None:
    """The re-tune's outcome when every sweep ran and the recipe won each."""
    keys = [f"retune {f} sweep" for f in ("outer_lr", "outer_momentum", "learning_rate", "H")]
    if all(out.get(k) and all(out[k].values()) for k in keys):
        return "the recipe won every sweep (below)"
    return None


def _no_gain(out: dict, key: str, what: str = "the ablation") -> str | None:
    """A lever's outcome when nothing of `out[key]` beat the recipe at seed 0."""
    return f"no gain at seed 0 ({what} below)" if out.get(key) else None


def _batches(out: dict) -> list[str]:
    """The batch per machine count: the Muon all-reduce and the best 4-machine recipe at
    each batch (the same tokens), seed 0."""
    factors = sorted({*out.get("batch factors", ()), 1.0})
    if len(factors) < 2:
        return []
    lines = [
        "The batch per machine count (seed 0, the same tokens: the batch times the factor, "
        "the steps over it; each at its tuned rates; a winning edge extended): the "
        "all-reduce with Muon against the best 4-machine recipe (Muon inner, H=10, outer "
        "0.7 / 0.8):",
        "",
        "| batch | steps | all-reduce with Muon | 4 machines, Muon inner | gap at this batch |",
        "|---|---|---|---|---|",
    ]
    for f in factors:
        ar, dl = out.get(f"batch x{f:g} allreduce"), out.get(f"batch x{f:g} diloco")
        a = score(ar[0]) if ar else None
        d = score(dl[0]) if dl else None
        cells = [f"{v:.4f}" if v is not None else "not run yet" for v in (a, d)]
        change = f"{100 * (d / a - 1):+.2f}%" if a and d else "-"
        lines.append(
            f"| x{f:g} ({8 * f:g} window{'' if 8 * f == 1 else 's'} a worker) | {2000 / f:,.0f} | {cells[0]} | "
            f"{cells[1]} | {change} |"
        )
    return lines + [""]


def section(out: dict, config, docs: str) -> str:
    """The section from `scale.plan`'s runs (`config`: the lm study's recipe)."""
    del docs  # no plots
    base = out.get("allreduce")
    muon_ar = out.get("muon allreduce")
    batch_ar = out.get("batch allreduce best")
    # Every gap is against the best tuned data-parallel baseline: Adam's, Muon's, or
    # Muon's at its own best batch.
    beta_ar = out.get("combined allreduce")
    retuned_ar = out.get("retune allreduce")
    means = [mean(r) for r in (base, muon_ar, batch_ar, beta_ar, retuned_ar) if r]
    target = float(min(means)) if means else None
    lines = [
        "## Beyond two machines",
        "",
        "DiLoCo at 2, 4 and 8 machines on the lm study's protocol (configs/lm_tiny.py's "
        f"transformer, {config.num_steps:,} steps, the same 8 workers and tokens per step "
        "at every machine count) against the best tuned data-parallel baseline: the fp32 "
        f"all-reduce with Adam ({cell(base)} bits per byte over 3 seeds) or with Muon "
        f"({cell(muon_ar)}; at its own best batch, same tokens: {cell(batch_ar)}), "
        "whichever ends lower; every gap below is against it "
        f"({target if target is None else f'{target:.4f}'}). Command: `{COMMAND}` "
        "(bench/experiments/scale.py; each run 2-4 min on 2 cores).",
        "",
        "| machines | recipe | setting | final validation bits per byte (gap) | bytes / worker / step between machines | of the Adam all-reduce's (FSDP) | scaling-law study, 35M (2503.09799 Table 4) | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [
        (2, "2-machine recipe (configs/lm_study.py)", out.get("2 machines")),
        (
            2,
            "the best 4-machine recipe at its best batch (re-tuned there)",
            out.get("retune 2 machines"),
        ),
        (4, "2-machine recipe", out.get("4 machines recipe")),
        (4, "tuned at H=10: outer lr x momentum", out.get("4 machines H=10 best")),
        (4, "tuned at H=5: outer lr x momentum", out.get("4 machines H=5 best")),
        (
            4,
            "H=10 tuned, the outer momentum decayed over the last rounds",
            out.get("decay best")
            or ("no gain at seed 0 (the ablation below)" if out.get("decay ablation") else None),
        ),
        (4, "H=10 tuned, Muon inner (its learning rate swept)", out.get("muon diloco")),
        (
            4,
            "Muon inner, the outer lr swept again",
            out.get("muon outer best") or _kept(out, "muon outer sweep"),
        ),
        (
            4,
            "Muon inner, a slow outer momentum beside the fast one (MT-DAO)",
            out.get("slow best")
            or ("no gain at seed 0 (the ablation below)" if out.get("slow ablation") else None),
        ),
        (
            4,
            "Muon inner, the outer momentum swept at its outer lr",
            out.get("muon momentum best") or _kept(out, "muon momentum sweep", "momentum"),
        ),
        (
            4,
            "Muon inner at H=5 (twice the exchanges), its outer momentum swept",
            out.get("muon h5 best") or _no_gain(out, "muon h5 sweep", "the sweep"),
        ),
        (
            4,
            "Muon inner, Muon's own momentum swept",
            out.get("muon beta best") or _no_gain(out, "muon beta ablation"),
        ),
        (
            4,
            f"Muon inner at its best batch (x{out.get('batch diloco best factor', 1):g}, "
            "the same tokens)",
            out.get("batch diloco best") or _batch_kept(out),
        ),
        (
            4,
            "Muon inner at its best batch with Muon's best momentum (`muon_beta`)",
            out.get("combined"),
        ),
        (
            4,
            "Muon inner at its best batch, re-tuned there (outer lr, outer momentum, Muon's "
            "rate, H; one at a time)",
            out.get("retune best") or _retune_kept(out),
        ),
        (8, "2-machine recipe", out.get("8 machines recipe")),
        (
            8,
            "the best 4-machine recipe: Muon inner at H=10's tuned outer step",
            out.get("8 machines best"),
        ),  # fmt: skip
        (
            8,
            "the same, its outer lr swept again",
            out.get("8 machines tuned") or _kept(out, "8 machines sweep"),
        ),
        (
            8,
            f"the 4-machine levers' best ({LEVERS.get(out.get('8 machines lever from'), '-')})",
            out.get("8 machines lever"),
        ),
        (
            8,
            f"Muon inner at the 4-machine best batch (x{out.get('batch diloco best factor', 1):g})",
            out.get("batch 8 machines") or _batch_kept(out),
        ),
        (
            8,
            "Muon inner at the 4-machine best batch with Muon's best momentum",
            out.get("combined 8 machines"),
        ),
        (
            8,
            "Muon inner at the 4-machine best batch, re-tuned there on 4 machines",
            out.get("retune 8 machines"),
        ),
    ]
    for machines, recipe, records in rows:
        goal = f"within +{GOALS[machines]:.1f}%" if machines in GOALS else "-"
        if isinstance(records, str):
            lines.append(f"| {machines} | {recipe} | - | {records} | - | - | - | {goal} |")
            continue
        lines.append(
            f"| {machines} | {recipe} | {_setting(records)} | {cell(records, target)} | "
            f"{_bytes(records)} | {_fraction(records, base)} | +{FIELD_35M[machines]:.1f}% | {goal} |"
        )
    lines += [
        "",
        "The data-parallel baselines: the all-reduce with Adam "
        f"{cell(base, target)}; with Muon {cell(muon_ar, target)}"
        + (
            f"; with Muon at its best batch (x{out['batch allreduce best factor']:g}, the "
            f"same tokens) {cell(batch_ar, target)}"
            if batch_ar
            else ""
        )
        + (
            f"; with Muon at that batch and DiLoCo's best muon_beta {cell(beta_ar, target)}"
            if beta_ar
            else (
                f"; with Muon at that batch and DiLoCo's best muon_beta, seed 0 "
                f"{score(out['combined allreduce seed 0'][0]):.4f} (not better than its own)"
                if out.get("combined allreduce seed 0")
                else ""
            )
        )
        + (
            f"; with Muon at that batch, that muon_beta and its rate swept again "
            f"{cell(retuned_ar, target)}"
            if retuned_ar
            else ""
        )
        + ".",
        "",
    ]
    outer = ("outer_lr", "outer_momentum")
    for h in (10, 5):
        lines += _sweep(f"4 machines, H={h}: outer learning rate x momentum",
                        out.get(f"4 machines H={h} sweep"), outer)  # fmt: skip
    lines += _sweep("All-reduce with Muon: learning rate", out.get("muon allreduce sweep"),
                    ("learning_rate",))  # fmt: skip
    lines += _sweep("4 machines, DiLoCo with Muon inner: learning rate",
                    out.get("muon diloco sweep"), ("learning_rate",))  # fmt: skip
    lines += _sweep("4 machines, Muon inner: outer learning rate",
                    out.get("muon outer sweep"), ("outer_lr",))  # fmt: skip
    lines += _sweep("8 machines, Muon inner: outer learning rate", out.get("8 machines sweep"),
                    ("outer_lr",))  # fmt: skip
    lines += _sweep("4 machines, Muon inner: outer momentum at outer lr 0.7",
                    out.get("muon momentum sweep"), ("outer_momentum",))  # fmt: skip
    lines += _sweep("4 machines, Muon inner at H=5: outer momentum at H=5's outer lr",
                    out.get("muon h5 sweep"), ("outer_momentum",))  # fmt: skip
    lines += _batches(out)
    factor = out.get("batch diloco best factor")
    if factor is not None and any(k.startswith("retune") for k in out):
        at = f"at its best batch (x{factor:g})"
        for field in ("outer_lr", "outer_momentum", "learning_rate"):
            lines += _sweep(f"4 machines, Muon inner {at}, re-tuned: {field}",
                            out.get(f"retune {field} sweep"), (field,))  # fmt: skip
        h_sweep = out.get("retune H sweep")
        lines += _sweep(f"4 machines, Muon inner {at}, re-tuned: H",
                        h_sweep and {(h,): r for h, r in h_sweep.items()}, ("H",))  # fmt: skip
        lines += _sweep(f"The all-reduce with Muon {at}, muon_beta as the best baseline's: "
                        "learning rate", out.get("retune allreduce sweep"), ("learning_rate",))  # fmt: skip
        if out.get("retune best from"):
            lines += [
                f"The re-tuned recipe's winners went to 3 seeds as "
                f"{_RETUNE_FROM.get(out['retune best from'], out['retune best from'])}"
                + (
                    f" (the winners together, {_fields(together)}, seed 0: {score(together):.4f})"
                    if (together := (out.get("retune together seed 0") or [None])[0])
                    else ""
                )
                + "; 8 machines at the same fields (H at least 10 there: below it 8 machines "
                "pass 1/16 of the all-reduce's bytes).",
                "",
            ]
    betas = out.get("muon beta ablation")
    if betas:
        base = (out.get("muon diloco") or [None])[0]
        lines += [
            "A third lever at the best 4-machine recipe (seed 0): Muon's own momentum "
            "(`muon_beta`), each machine's buffer carried across the rounds:",
            "",
            "| muon_beta | bits per byte |",
            "|---|---|",
            f"| 0.95 (the recipe) | {'not run yet' if base is None else f'{score(base):.4f}'} |",
        ]
        for beta, records in sorted(betas.items()):
            value = "not run yet" if not records else f"{score(records[0]):.4f}"
            lines.append(f"| {beta:g} | {value} |")
        lines.append("")
    decays = out.get("decay ablation")
    if decays:
        base = (out.get("4 machines H=10 best") or [None])[0]
        lines += [
            "The lever at H=10's winner (seed 0): the outer momentum falling linearly to 0 "
            "over the run's last rounds (`outer_decay_rounds`; Pier, arXiv 2511.17849, warms "
            "it up and decays it):",
            "",
            "| rounds of decay | bits per byte |",
            "|---|---|",
            f"| 0 (H=10's winner) | {'not run yet' if base is None else f'{score(base):.4f}'} |",
        ]
        for decay, records in sorted(decays.items()):
            value = "not run yet" if not records else f"{score(records[0]):.4f}"
            lines.append(f"| {decay} | {value} |")
        lines.append("")
    slows = out.get("slow ablation")
    if slows:
        base = (out.get("muon diloco") or [None])[0]
        lines += [
            "The second lever at the best 4-machine recipe (Muon inner, H=10, outer 0.7 / "
            "0.8; seed 0): a slow Nesterov momentum mixed into the outer step beside the "
            "fast one at the same steady gain (`outer_slow_momentum`, `outer_slow_weight`; "
            "MT-DAO, arXiv 2510.05361, keeps slow and fast moments side by side):",
            "",
            "| slow momentum | its weight | bits per byte |",
            "|---|---|---|",
            f"| - | 0 (the recipe) | {'not run yet' if base is None else f'{score(base):.4f}'} |",
        ]
        for (momentum, weight), records in sorted(slows.items()):
            value = "not run yet" if not records else f"{score(records[0]):.4f}"
            lines.append(f"| {momentum:g} | {weight:g} | {value} |")
        lines.append("")
    small_ar = out.get("lm_small allreduce")
    if small_ar:
        base_small = float(np.mean([score(r) for r in small_ar]))
        parts = []
        for key, what in (("lm_small recipe", "the 2-machine recipe (0.7 / 0.6)"),
                          ("lm_small tuned", "H=10's winner here")):  # fmt: skip
            records = out.get(key)
            parts.append(f"{what} {cell(records, base_small)} over {_seeds(records)}")
        lines += [
            "configs/lm_small.py (1.29M parameters, Adam 2e-3 inside, the lm study's "
            "headline model), 4 machines x 2 at H=10, against its Adam all-reduce "
            f"({cell(small_ar)} over {_seeds(small_ar)}; Muon's all-reduce was not run "
            "on it): " + "; ".join(parts) + ".",
            "",
        ]
        small_muon_ar, small_muon = (
            out.get("lm_small muon allreduce"),
            out.get("lm_small muon diloco"),
        )
        if small_muon_ar or small_muon:
            lines += [
                "With Muon there, at lm_tiny's Muon rates (not swept on lm_small; Adam's part "
                "at lm_small's 2e-3), seed 0, against the Adam all-reduce's mean: the "
                f"all-reduce with Muon {cell(small_muon_ar, base_small)}; the best 4-machine "
                f"recipe (Muon inner, H=10, 0.7 / 0.8) {cell(small_muon, base_small)}"
                + (
                    f", {100 * (score(small_muon[0]) / score(small_muon_ar[0]) - 1):+.2f}% "
                    "from the Muon all-reduce"
                    if small_muon and small_muon_ar
                    else ""
                )
                + ".",
                "",
            ]
    for machines in (4, 8):
        gaps = [gap(r, target) for m, _, r in rows if m == machines and isinstance(r, list)]
        gaps = [g for g in gaps if g is not None]
        if gaps and machines in GOALS:
            met = "met" if min(gaps) <= GOALS[machines] else "not met"
            lines.append(
                f"- {machines} machines: best gap {min(gaps):+.2f}% against the goal "
                f"+{GOALS[machines]:.1f}%: {met}."
            )
    return "\n".join(lines) + "\n"
