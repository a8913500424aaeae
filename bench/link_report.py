"""bench/link.py's report: times to target, the tables, the BENCHMARKS.md section, the plot.

Everything here reads the results `bench.link.measure` wrote (a dict per method: its
link bytes, and per rate its seconds per step, utilisation and metric curve), so a
section can be rendered again from a results file (`python -m bench.link
--from-results`) without training.
"""

from __future__ import annotations

import datetime
import math
import os
import platform

from bench import _sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The rate name of the link with no qdisc.
UNSHAPED = "unshaped"
#: The method every other is timed against (`--target final` reads its final metric).
BASELINE = "allreduce"


def modelled_cell(result: dict) -> str:
    """The table's "link bytes/step (model)" cell: `link_share`'s figure, or for a
    results file from before it, the operand bytes it kept, marked "(operands)"."""
    if "modelled_link_bytes_per_step" in result:
        return megabytes(result["modelled_link_bytes_per_step"])
    old = result.get("compiled_link_bytes_per_step", result["compiled_bytes_per_step"])
    return megabytes(old) + ("" if math.isnan(old) else " (operands)")  # NaN: DDP, no count


def curve(
    rows: list[dict], metric: str = "test_accuracy_avg_model", clock: bool = False
) -> list[tuple[float, float]]:
    """(seconds so far, the node-averaged model's `metric`) at each metrics.csv row.

    Seconds of training (`step_time_s` x steps); with `clock`, plus each row's
    evaluation (`eval_time_s`): the loop's own clock, without start-up and compilation.
    """
    points, elapsed, previous = [], 0.0, 0
    for row in rows:
        elapsed += row["step_time_s"] * (row["step"] - previous)
        if clock:
            elapsed += row.get("eval_time_s", 0.0)
        previous = int(row["step"])
        points.append((elapsed, row[metric]))
    return points


def time_to_target(
    points: list[tuple[float, float]], target: float | None, lower_is_better: bool = False
) -> float | None:
    """The time of the first `curve` point at or past `target`, or None (or no target)."""
    if target is None:
        return None
    for elapsed, value in points:
        if (value <= target) if lower_is_better else (value >= target):
            return elapsed
    return None


def targets(results: list[dict], rates: list[str], target: float | None) -> dict[str, float]:
    """The target accuracy per rate: `target`, or (None) the baseline's final accuracy there."""
    if target is not None:
        return {rate: target for rate in rates}
    base = next((r for r in results if r["method"] == BASELINE), None)
    if base is None:
        raise ValueError(f"--target=final needs the baseline {BASELINE!r} among the methods")
    if "error" in base:  # the tables still show every method's other numbers
        return {rate: None for rate in rates}
    return {rate: base["rates"][rate]["final_accuracy"] for rate in rates}


def megabytes(value: float) -> str:
    """Bytes as megabytes, or a dash for none (NaN)."""
    return "—" if math.isnan(value) else f"{value / 1e6:.3f} MB"


def table(results: list[dict], rate: str, target: float, workload) -> str:
    """One rate's table of every method (`workload`: bench.link's `Workload`)."""
    lower = workload.lower_is_better
    for r in results:
        if "error" not in r and rate in r["rates"]:
            at = r["rates"][rate]
            at["target"] = target
            at["time_to_target_s"] = time_to_target(at["curve"], target, lower)
            at["clock_to_target_s"] = time_to_target(at.get("clock_curve", []), target, lower)
    base = next((r for r in results if r["method"] == BASELINE and "error" not in r), None)
    base_time = base["rates"][rate]["time_to_target_s"] if base else None
    if target is None:
        shown_target = "target (none: the baseline failed)"
    else:
        shown_target = f"{target:.3f}" if lower else f"{target:.1%}"
    tokens = workload.tokens
    lines = [
        f"| method | s/step | link bytes/step (measured) | link bytes/step (model) | utilisation "
        f"| time to {shown_target} | vs fp32 all-reduce | ceiling | of ceiling "
        f"| vs all-reduce at equal {workload.metric_name} | evaluation adds "
        f"| final {workload.metric_name} |" + (" tokens/s per machine |" if tokens else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if tokens else ""),
    ]
    for r in results:
        if "error" in r or rate not in r["rates"]:
            why = f"failed: {r['error']}" if "error" in r else "not run at this rate"
            lines.append(f"| {r['label']} | {why} |" + " |" * (10 + tokens))
            continue
        at = r["rates"][rate]
        ttt = at["time_to_target_s"]
        speedup = f"{base_time / ttt:.2f}x" if base_time and ttt else "—"
        # The ceiling: the all-reduce's time to target on this link over the method's on
        # the unshaped link (its steps to target at its compute-only speed), what these
        # cores allow the method if the link cost it nothing; "of ceiling": the speed-up
        # over it, i.e. the method's unshaped time over its time on this link.
        ceiling = of_ceiling = "—"
        free = r["rates"].get(UNSHAPED, {}).get("curve")
        free_ttt = time_to_target(free, target, lower) if free else None
        if base_time and free_ttt:
            ceiling = f"{base_time / free_ttt:.2f}x"
            if ttt:
                of_ceiling = f"{free_ttt / ttt:.0%}"
        final = at["final_accuracy"]
        combined = " (c)" if at.get("combined") else ""
        # The all-reduce's time to this method's own final value, over this method's time.
        equal = "—"
        if base is not None and at["curve"]:
            reached = time_to_target(base["rates"][rate]["curve"], final, lower)
            if reached:
                equal = f"{reached / at['curve'][-1][0]:.2f}x"
                # Its ceiling: the same over the method's whole time on the unshaped link.
                if free and ttt is None:
                    equal += (
                        f" (ceiling {reached / free[-1][0]:.2f}x, "
                        f"{free[-1][0] / at['curve'][-1][0]:.0%} of it)"
                    )
        evaluation = "—"
        if at.get("clock_curve") and at["curve"]:
            evaluation = f"+{at['clock_curve'][-1][0] / at['curve'][-1][0] - 1:.1%}"
        lines.append(
            f"| {r['label']} | {at['s_per_step']:.3f}{combined} "
            f"| {megabytes(r['link_bytes_per_step'])} "
            f"| {modelled_cell(r)} "
            f"| {at['utilisation']:.0%} "
            f"| {f'{ttt:.1f} s' if ttt is not None else 'not reached'} | {speedup} "
            f"| {ceiling} | {of_ceiling} | {equal} | {evaluation} "
            f"| {f'{final:.3f}' if lower else f'{final:.1%}'} |"
            + (f" {at.get('tokens_per_s_per_machine', 0):,.0f} |" if tokens else "")
        )
    return "\n".join(lines)


def shown(path: str) -> str:
    """`path` relative to the repository when it lies inside it."""
    relative = os.path.relpath(path, ROOT)
    return path if relative.startswith("..") else relative


def section(all_results: dict, args, command: str, workload) -> str:
    """The BENCHMARKS.md section: how it was measured, then a `table` per processes and rate."""
    quick = " (QUICK SMOKE RUN: not representative)" if args.quick else ""
    if args.target is None:
        target_text = f"the fp32 all-reduce's final {workload.metric_name} on the same link"
    elif workload.lower_is_better:
        target_text = f"{args.target:g}"
    else:
        target_text = f"{args.target:.0%}"
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores shared by every process"
    what = "language model, " if args.workload == "lm" else ""
    combined = ""
    if args.shaped_steps:
        combined = (
            f" (c): the run at this rate was {args.shaped_steps} steps long, for its seconds "
            "per step and per evaluation; its times to target put those on the unshaped "
            f"run's {workload.metric_name} per step, which lpdec's synchronous methods "
            "compute the same whatever the link's speed."
        )
    parts = [
        f"## Training across a shaped link (`bench/link.py`), {what}{args.workload}{quick}",
        "",
        f"`{command}`",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine}; {_sections.versions()}.",
        "",
        f"P processes of `train.py` (`{shown(args.config)}` plus each method's "
        f"fields; {args.devices} CPU devices each, gloo"
        + (
            "; each process pinned to a core of its own with one thread, PyTorch DDP too"
            if getattr(args, "pin", False)
            else ""
        )
        + "), each in its own network namespace, "
        "joined by veth links shaped with htb at each host's egress. s/step: median chunk "
        f"time per step over {args.steps} steps; link bytes: host 0's veth transmit counter, "
        f"difference of unshaped runs of {args.probe_steps[1]} and {args.probe_steps[0]} "
        "steps; link bytes (model): what train.py's traffic meter says a host puts on the "
        "link per step (`link_bytes_by_axis`, each collective by its bandwidth-optimal "
        "algorithm, `lpdec.wire.LINK_SHARE`; with machines of several devices, the "
        "machines axis's bytes times the devices; (operands): a run from before the meter "
        "modelled links, its collectives' operand bytes); unshaped: the veth with no qdisc "
        "(as fast as the kernel copies, on the same CPU cores); utilisation: unshaped "
        "s/step / shaped s/step; time to "
        f"target: training time until the node-averaged model reaches the target "
        f"{workload.metric_name} ({target_text}; compilation not counted); at equal "
        f"{workload.metric_name}: the all-reduce's training time to this method's final value "
        "over this method's whole training time (for methods that end short of the target), "
        "with its ceiling: the same over the method's whole time on the unshaped link, and "
        "the fraction of it reached; "
        "ceiling: the all-reduce's time to target on this link over the method's on the "
        "unshaped link (the speed-up these cores allow if the link cost nothing), and of "
        "ceiling: the speed-up over it; "
        "evaluation adds: the run's evaluations at the config's logging interval over its "
        "training time. "
        "DiLoCo runs are measured over whole rounds (probes, rows and runs are multiples of "
        f"H).{combined} Plot: `{shown(args.plot)}`.",
    ]
    for processes, results in all_results.items():
        rates = [UNSHAPED] + args.rates
        for rate, target in targets(results, rates, args.target).items():
            parts += [
                "",
                f"### {processes} processes x {args.devices} devices, {rate} link",
                "",
                table(results, rate, target, workload),
            ]
    return "\n".join(parts)


def plot(all_results: dict, args, workload) -> None:
    """`--plot`: the node-averaged model's metric against training time, a panel per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, rate) for p in all_results for rate in [UNSHAPED] + args.rates]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True
    )
    for ax, (processes, rate) in zip(axes[0], panels, strict=True):
        for r in all_results[processes]:
            if "error" in r or rate not in r["rates"]:
                continue
            xs, ys = zip(*r["rates"][rate]["curve"], strict=True)
            ax.plot(xs, ys, marker=".", label=r["label"])
        target = targets(all_results[processes], [rate], args.target)[rate]
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"{processes} processes x {args.devices} devices, {rate} link")
        ax.set_xlabel("training time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{workload.metric_name} (node-averaged model)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot, dpi=120)
