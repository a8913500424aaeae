"""What every study's section is made of: the numbers of its tables, its figures, its header
line, and EXPERIMENTS.md's own header and runtime table."""

from __future__ import annotations

import json
import time

import numpy as np

from bench.experiments.cache import DRY_RUN_NOTE
from bench.experiments.cache import STUDIES
from bench.experiments.runner import STEPS

HEADER = """# Experiments: the seeds' claims at training length

Produced by `python -m bench.experiments all` (see `bench/experiments/` for
every setting). CIFAR-10 and the NLP sets cannot be downloaded here, so each
study reproduces a claim of seeds 001-004 on MNIST-1D (generated locally) with
a 1-D CNN, on 8 simulated CPU devices of a 2-core machine. Each section was
written by the command in its header and states its own settings; the same
studies run the full-size paper settings through the CIFAR-10 configs
(`configs/cifar10_*.py`) on a machine with the data and a GPU. The training
recipes are `configs/mnist1d_seed002.py` (seed 002's: Nesterov, step decay x0.1
at 50% and 75%) and `configs/mnist1d_seed003.py` (seed 003's); any run can be
repeated with `train.py` and the fields docs/experiments.json lists for it. The
studies "lm" and "scale" measure the DiLoCo family as its own papers do, on a
byte-level transformer language model trained on this Python's standard library
sources, each method at its own tuned setting: on 2 machines, then on 4 and 8.

Every run's config, seed, schedule, final accuracy, bytes and time are in
`docs/experiments.json`; `python -m bench.experiments all --render` rebuilds
these tables and plots from that file alone. Runs are cached by config and by a
fingerprint of the training code (`runs/experiments/results.json`; the runs in
docs/experiments.json count as cached while that fingerprint holds): changing
either trains them again.

<!-- runtime:start -->
<!-- runtime:end -->
"""

COLLAPSE_POINTS = 20.0  # a run that ends this far below its best accuracy collapsed


def accuracy(records) -> tuple[float, float]:
    """Mean and std over the records of the averaged model's final test accuracy (%)."""
    values = 100 * np.array([r["final_test_accuracy"] for r in records])
    return float(values.mean()), float(values.std())


def fmt(records) -> str:
    """A table cell: mean ± std (%) over the seeds, and how many diverged."""
    mean, std = accuracy(records)
    text = f"{mean:.1f} ± {std:.1f}" if len(records) > 1 else f"{mean:.1f}"
    diverged = sum(r["diverged"] for r in records)
    return text + (f" ({diverged} diverged)" if diverged else "")


def mean_curve(records) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the averaged model's test accuracy (%) over them, mean over the seeds."""
    steps = np.array([row[0] for row in records[0]["curve"]])
    length = min(len(r["curve"]) for r in records)
    accs = 100 * np.mean([[row[1] for row in r["curve"][:length]] for r in records], axis=0)
    return steps[:length], accs


def collapse(record) -> float:
    """Points the averaged model's test accuracy lost from its best to the end."""
    return 100 * (max(c[1] for c in record["curve"]) - record["final_test_accuracy"])


def collapsed_seeds(records) -> list[int]:
    """The seeds whose run collapsed."""
    return [r["seed"] for r in records if collapse(r) > COLLAPSE_POINTS]


def collapses(collapsed) -> str:
    """Which runs collapsed (ended more than COLLAPSE_POINTS below their best accuracy)."""
    where = [
        f"{column}, {row}: seed {', '.join(map(str, seeds))}"
        for (row, column), seeds in collapsed.items()
        if seeds
    ]
    if not where:
        return (
            f"No run of this study collapsed (ended more than {COLLAPSE_POINTS:g} points "
            "below its best)."
        )
    return (
        f"Runs that collapsed (ended more than {COLLAPSE_POINTS:g} points below their best "
        f"accuracy; they count in the means above): {'; '.join(where)}."
    )


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(results, path, title):
    """Writes the mean accuracy curve of each label's records to `path`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for label, records in results.items():
        steps, accs = mean_curve(records)
        ax.plot(steps, accs, marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy of the averaged model (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_accuracy_vs_bytes(results, path, title, wall=None):
    """Writes each label's mean accuracy against MB sent per node (or, given the seconds
    per step of each label in `wall`, against simulated wall-clock time) to `path`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, records in results.items():
        steps, accs = mean_curve(records)
        if wall is None:
            xs = steps * records[0]["bytes_per_node_per_step"] / 1e6
        else:
            xs = steps * wall[label]
        ax.plot(np.maximum(xs, 1e-3), accs, marker="o", markersize=3, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per node" if wall is None else "simulated wall-clock time (s)")
    ax.set_ylabel("test accuracy of the averaged model (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timing(runner, minutes: float, rendered: bool) -> str:
    """How long a study took: this invocation's wall time and its runs' training time."""
    # Cached runs report their own (first) training time, summed, besides this
    # invocation's wall time; a render reports only the former.
    if runner.dry_run:
        where = (
            "rendered from docs/experiments.json"
            if rendered
            else f"{len(runner.study_keys)} configs checked in {minutes:.1f} min"
        )
        return f"DRY RUN, nothing trained: every number is a placeholder; {where}"
    runs = (
        f"its {len(runner.study_keys)} training runs took {runner.trained_seconds / 60:.1f} min"
        if runner.study_keys
        else ""
    )
    if rendered:
        return (runs or "no training runs") + "; rendered from docs/experiments.json"
    text = f"{minutes:.1f} min wall" + (f"; {runs}" if runs else "")
    if runner.trained_seconds > 1.2 * minutes * 60:
        text += " (some were trained by an earlier invocation and read from the cache)"
    return text


def with_command(body: str, command: str, timing: str) -> str:
    """The section `body` with a line under its title: the command, its timing, the date."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return body.replace(
        "\n", f"\n\n_Command: `{command}`; {timing} on this machine ({stamp})._\n", 1
    )


def runtime(json_path: str) -> str:
    """The training time of each study's runs, from docs/experiments.json."""
    with open(json_path) as f:
        data = json.load(f)
    runs = data["runs"]
    note = f"{DRY_RUN_NOTE} The times are the checks'.\n\n" if data.get("dry_run") else ""
    seconds = {e["key"]: e["wall_clock_s"] for e in runs}
    steps = {e["key"]: e["steps"] for e in runs}
    # Many runs shared the machine with other jobs; a run alone takes about the
    # fastest tenth of the full-length runs' times (per step).
    full = [e["wall_clock_s"] / e["steps"] for e in runs if e["steps"] >= STEPS]
    per_step = float(np.percentile(full, 10)) if full else 0.0
    rows = []
    for study in STUDIES:
        keys = {e["key"] for e in runs if e["study"] == study}
        if keys:
            minutes = sum(seconds[k] for k in keys) / 60
            alone = sum(steps[k] for k in keys) * per_step / 60
            rows.append(f"| {study} | {len(keys)} | {minutes:.0f} | {alone:.0f} |")
    total = sum(seconds.values()) / 60
    total_alone = sum(steps.values()) * per_step / 60
    return f"""{note}Training time on this machine (2 CPU cores, 8 simulated devices), from
docs/experiments.json; a run two studies share (the tradeoff study reuses the
moniqua and centralized runs at skew 0) is counted in both rows but once in
the total. theorem1 is not a training run (seconds). Most runs shared the
2 cores with other jobs (test suites, pilot runs), which slowed them up to 3x;
"alone" is the steps trained times the fastest tenth of the full-length runs'
time per step ({1e3 * per_step:.1f} ms), what a run on an idle machine takes.
Diverged runs stop early.

| study | training runs | minutes, as measured | minutes alone (estimate) |
|---|---|---|---|
{chr(10).join(rows)}
| all | {len(seconds)} | {total:.0f} | {total_alone:.0f} |
"""
