"""Study "centralized": the compressed all-reduces of seeds 001 (two-round) and 004
(hierarchical)."""

# Markdown table rows are long lines by nature.

from __future__ import annotations

from bench.experiments.gamma import EIGHT_BIT
from bench.experiments.render import accuracy
from bench.experiments.render import fmt
from bench.experiments.runner import Runner
from bench.experiments.runner import describe_schedule
from bench.experiments.runner import seed003_config

CENTRAL_METHODS = {
    "all-reduce fp32": dict(algorithm="allreduce"),
    "two-round 8-bit (QSGD-TF, seed 001)": dict(algorithm="compressed_mean", **EIGHT_BIT),
    "hierarchical 8-bit, 2 x 4 (seed 004)": dict(
        algorithm="compressed_mean", devices=2, hierarchical=True, **EIGHT_BIT
    ),
}


def centralized_runs(runner: Runner, study: str, skew: float = 0.0, labels=None) -> dict:
    """{label: records} of CENTRAL_METHODS (those in `labels`, default all) at `skew`."""
    return {
        label: runner.repeat(study, label, seed003_config, skew=skew, **kw)
        for label, kw in CENTRAL_METHODS.items()
        if labels is None or label in labels
    }


def centralized(runner: Runner, docs: str) -> str:
    """Seeds 001/004: compressed all-reduce of gradients, flat and hierarchical."""
    results = centralized_runs(runner, "centralized")
    base = accuracy(results["all-reduce fp32"])[0]

    def across(record):
        # Bytes over the inter-machine axis: everything for the flat methods.
        by_axis = record.get("bytes_by_axis") or {}
        if len(by_axis) > 1:
            return by_axis.get("nodes", record["bytes_per_node_per_step"])
        return record["bytes_per_node_per_step"]

    rows = [
        f"| {label} | {fmt(r)} | {accuracy(r)[0] - base:+.1f} | "
        f"{r[0]['bytes_per_node_per_step']:,.0f} | {across(r[0]):,.0f} |"
        for label, r in results.items()
    ]
    worst = min(accuracy(r)[0] for r in results.values())
    return f"""## Seeds 001 and 004: compressed all-reduce

Every node holds the same model; gradients are averaged by a full-precision
all-reduce, by the two-round 8-bit exchange of seed 001 (scatter-reduce then
all-gather of stochastically rounded 8-bit chunks), or hierarchically (seed
004) on a 2 x 4 layout: 2 "machines" (CPU devices) of 4 nodes each, a
full-precision reduce inside a machine, the 8-bit exchange between machines,
a broadcast inside. IID data, 8 nodes, the Moniqua study's recipe (momentum 0.9,
weight decay 5e-4, {describe_schedule(seed003_config(runner.quick))}), so the
tradeoff study can set these runs beside gossip. Bytes: what one node hands to
collectives per step (all-reduce: its whole gradient; compressed: the codes and
scales of its chunks); for the hierarchical layout (counted at trace time) the
full-precision traffic inside a machine and the 8-bit traffic between machines
are listed apart: only the latter crosses the slow link.

| method | test accuracy (%) | vs all-reduce | bytes / node / step, all | bytes / node / step between machines |
|---|---|---|---|---|
{chr(10).join(rows)}

| claim (seeds 001 / 004) | what we measured | verdict |
|---|---|---|
| 8-bit gradient exchange converges like full precision at about a quarter of the bytes | all methods within {base - worst:.1f} points of the fp32 all-reduce | {"agrees" if base - worst <= 1.0 else "does not agree"} |
"""
