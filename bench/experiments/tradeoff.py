"""Study "tradeoff": accuracy against bytes and against simulated wall-clock time for
gossip, all-reduce and the local-step methods, IID and at skew 0.9."""

# Markdown table rows are long lines by nature.

from __future__ import annotations

import os

from bench.experiments.centralized import centralized_runs
from bench.experiments.gamma import EIGHT_BIT
from bench.experiments.gamma import chosen_gamma
from bench.experiments.moniqua import MONIQUA_MODEL_THETA
from bench.experiments.moniqua import MONIQUA_STOCHASTIC
from bench.experiments.moniqua import moniqua_runs
from bench.experiments.render import fmt
from bench.experiments.render import plot_accuracy_vs_bytes
from bench.experiments.runner import Runner
from bench.experiments.runner import describe_schedule
from bench.experiments.runner import seed003_config

# Link model of the simulated wall clock.
BANDWIDTH_BITS_PER_S = 100e6
LATENCY_S = 1e-3
DILOCO = dict(algorithm="diloco", local_steps=10, outer_lr=0.7, outer_momentum=0.9)
LOCAL_METHODS = {
    "DiLoCo H=10, fp32 mean": dict(DILOCO, exchange="mean", compressor="identity"),
    "DiLoCo H=10, 4-bit EF": dict(
        DILOCO, exchange="compressed_mean", compressor="minmax", bits=4, error_feedback=True
    ),
    "DiLoCo H=10, 2-bit EF": dict(
        DILOCO, exchange="compressed_mean", compressor="minmax", bits=2, error_feedback=True
    ),
    "DiLoCo H=10 over CHOCO 8-bit gossip": dict(DILOCO, exchange="gossip", **EIGHT_BIT),
}
TRADEOFF_GOSSIP = ("D-PSGD fp32", "CHOCO 8-bit")
# Moniqua with theta fitted to this model (the moniqua study's ablation): at the
# paper's theta = 2 it loses 4 points at 4 bits, which says nothing about its cost.
TRADEOFF_MONIQUA = (
    "Moniqua 4-bit, theta 0.1",
    dict(MONIQUA_STOCHASTIC, bits=4, theta=MONIQUA_MODEL_THETA),
)
TRADEOFF_CENTRAL = ("all-reduce fp32", "two-round 8-bit (QSGD-TF, seed 001)")


def tradeoff(runner: Runner, docs: str) -> str:
    """Accuracy against bytes and simulated wall-clock time, IID and at skew 0.9."""
    skews = (0.9,) if runner.quick else (0.0, 0.9)
    gossip_labels = TRADEOFF_GOSSIP[:2] if runner.quick else TRADEOFF_GOSSIP
    local = dict(list(LOCAL_METHODS.items())[:2]) if runner.quick else LOCAL_METHODS
    choco_gamma = chosen_gamma(runner, "CHOCO", "8-bit")
    compute = runner.repeat(
        "tradeoff", "compute only", seed003_config, seeds=1, algorithm="none", compressor="identity"
    )
    compute_step = float(compute[0]["step_time_s"])
    sections, all_rows = [], []
    for skew in skews:
        methods = moniqua_runs(runner, "tradeoff", skew, gossip_labels)
        if not runner.quick:
            label, kw = TRADEOFF_MONIQUA
            methods[label] = runner.repeat("tradeoff", label, seed003_config, skew=skew, **kw)
        methods.update(centralized_runs(runner, "tradeoff", skew, TRADEOFF_CENTRAL))
        for label, kw in local.items():
            kw = dict(kw, gamma=choco_gamma) if kw["exchange"] == "gossip" else kw
            methods[label] = runner.repeat("tradeoff", label, seed003_config, skew=skew, **kw)
        wall, rows = {}, []
        for label, records in methods.items():
            nbytes = records[0]["bytes_per_node_per_step"]
            collectives = records[0]["collectives_per_step"]
            comm = collectives * LATENCY_S + 8 * nbytes / BANDWIDTH_BITS_PER_S
            wall[label] = compute_step + comm
            for r in records:
                r["simulated_step_s"] = wall[label]
            rows.append(
                f"| {label} | {fmt(records)} | {nbytes:,.0f} | {collectives:.3g} | "
                f"{1e3 * comm:.2f} | {1e3 * wall[label]:.1f} | "
                f"{records[0]['steps'] * wall[label]:.0f} |"
            )
        tag = f"skew{skew:g}".replace(".", "")
        plot_accuracy_vs_bytes(
            methods,
            os.path.join(docs, f"tradeoff_bytes_{tag}.png"),
            f"8 nodes, skew {skew:g}: accuracy vs bytes",
        )
        plot_accuracy_vs_bytes(
            methods,
            os.path.join(docs, f"tradeoff_wallclock_{tag}.png"),
            f"8 nodes, skew {skew:g}, 100 Mbit/s, 1 ms",
            wall=wall,
        )
        sections.append(
            f"""### Skew {skew:g}

| method | test accuracy (%) | bytes / node / step | collectives / step | communication ms / step | simulated ms / step | simulated s for the run |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

![accuracy against bytes, skew {skew:g}](docs/tradeoff_bytes_{tag}.png)
![accuracy against simulated time, skew {skew:g}](docs/tradeoff_wallclock_{tag}.png)
"""
        )
        all_rows.append((skew, methods))
    ablation = ""
    if not runner.quick:
        label = "DiLoCo H=10, 2-bit EF"
        lines = []
        for skew, methods in all_rows:
            halved = runner.repeat(
                "tradeoff",
                f"{label}, outer lr 0.35",
                seed003_config,
                skew=skew,
                **dict(LOCAL_METHODS[label], outer_lr=0.35),
            )
            for outer, records in ((0.7, methods[label]), (0.35, halved)):
                per_seed = " / ".join(f"{100 * r['final_test_accuracy']:.1f}" for r in records)
                lines.append(f"| {skew:g} | {outer:g} | {per_seed} | {fmt(records)} |")
        ablation = f"""### Ablation: DiLoCo's 2-bit exchange and the outer step

The 2-bit error-feedback exchange with the outer learning rate halved (0.35
instead of 0.7), same seeds. Where seeds diverge at 0.7 and none does at 0.35,
the 2-bit pseudo-gradient (4 levels per chunk, rounded to the nearest: an error
up to a sixth of the chunk's range, carried over by error feedback and
amplified by the outer momentum) needs the smaller outer step on this model.

| skew | outer lr | test accuracy (%) per seed | mean ± std |
|---|---|---|---|
{chr(10).join(lines)}
"""
    share = max(
        r[0]["collectives_per_step"] * LATENCY_S
        + 8 * r[0]["bytes_per_node_per_step"] / BANDWIDTH_BITS_PER_S
        for _, methods in all_rows
        for r in methods.values()
    ) / (compute_step + 1e-12)
    scale = f"""This model has 12,298 parameters: a step computes for {1e3 * compute_step:.1f} ms
and the most any method spends on the simulated link is {100 * share:.0f}% of that,
so the simulated wall-clock times differ little here; bytes are the better
measure of what each method saves on a larger model, and `bench/link.py`
(BENCHMARKS.md) measures a 1.1M-parameter MLP on a real shaped link.
"""
    return f"""## Accuracy against bytes and against simulated wall-clock time

The main methods on 8 nodes with the Moniqua study's recipe (momentum 0.9, weight
decay 5e-4, {describe_schedule(seed003_config(runner.quick))}): gossip on the
undirected ring (D-PSGD, CHOCO 8-bit with the gamma study's gamma, Moniqua 4-bit
with theta = 0.1, fitted to this model: see the moniqua study), gradient all-reduce (fp32 and seed 001's two-round 8-bit), and the
local-step methods (issue 8): DiLoCo with H = 10 local steps, outer Nesterov (lr
0.7, momentum 0.9) on the pseudo-gradients, exchanged by a fp32 mean, by the
two-round compressed mean at 4 or 2 bits with error feedback, or by CHOCO 8-bit
gossip on the ring. Mean ± std over {runner.seeds} seed(s), IID and at skew 0.9.

Link model: each node has a 100 Mbit/s link with 1 ms latency; a step takes
the measured compute time of a node (a run with no communication on the same
layout: {1e3 * compute_step:.1f} ms per step) plus, for every collective of
the step (one ppermute per edge class for gossip, each all-to-all / all-gather
/ all-reduce for the centralized methods; DiLoCo's once every H steps, so 1/H
of them per step), the latency plus its bytes over the bandwidth, one after the
other. Bytes per collective are what the node hands to it (compiled program), so
an all-reduce counts its whole buffer once (a ring all-reduce would move 2(n-1)/n
of it and pay 2(n-1) latencies: the model favours all-reduce). Compute does not
overlap with communication. `bench/link.py` measures the same methods on a real
shaped link (BENCHMARKS.md).

{scale}
{chr(10).join(sections)}
{ablation}"""
