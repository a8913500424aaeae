"""Study "ad_psgd": AD-PSGD and Moniqua on AD-PSGD (seed 003, section 5, Theorem 5)
simulated iteration by iteration with `lpdec.async_sim`, against synchronous D-PSGD at
the same number of gradients, on the ring and on random edges of the complete graph,
with workers of equal and of unequal speed."""

# Markdown table rows are long lines by nature.

from __future__ import annotations

import json

import ml_collections
import numpy as np

import lpdec
from bench.experiments import async_train
from bench.experiments.render import accuracy
from bench.experiments.render import fmt
from bench.experiments.runner import QUICK_STEPS
from bench.experiments.runner import Runner
from bench.experiments.runner import describe_schedule
from bench.experiments.runner import placeholder
from bench.experiments.runner import seed003_config
from configs import default
from lpdec import async_sim

STEPS = 400  # synchronous steps; AD-PSGD runs STEPS x 8 iterations (the same gradients)
MAX_DELAY = 64  # tau_max, the cap on the delays the speeds produce
GRAPHS = {"ring": lambda: lpdec.ring(8), "complete (random edge)": lambda: lpdec.complete(8)}
SPEEDS = {"equal": None, "unequal (1 x4, 1/4 x4)": (1.0,) * 4 + (0.25,) * 4}
# theta: 8 bits at the paper's 2.0; 4 bits at 0.5, three times the largest neighbour
# gap (0.15) a 200-step full-precision AD-PSGD pilot reached on the ring at unequal speeds.
METHODS = {
    "AD-PSGD fp32": None,
    "Moniqua-AD-PSGD 8-bit, theta 2": lpdec.modulo(8, 2.0, "stochastic"),
    "Moniqua-AD-PSGD 4-bit, theta 0.5": lpdec.modulo(4, 0.5, "stochastic"),
}
SYNC = "D-PSGD fp32 (synchronous, same gradients)"


def _config(runner: Runner, seed: int, **fields):
    steps = task_steps(runner)
    config = runner.config(seed003_config, seed=seed, num_steps=steps, log_every=steps // 4)
    config.async_sim = ml_collections.ConfigDict(fields)
    return config


def _run(runner: Runner, tasks: dict, method: str, config, train) -> dict:
    """Runner.run for a run trained by `train(task, numbers)` here instead of by train.py
    (`numbers`: None, or a dry run's placeholder numbers, see async_train.train_async)."""
    key = runner.key(config)
    if runner.replay is not None:
        if key not in runner.replay:
            raise SystemExit(f"error: docs/experiments.json has no run of ad_psgd / {method}.")
        record = runner.replay[key]
    elif key in runner.cache:
        record = runner.cache[key]
    else:
        if config.seed not in tasks:
            tasks[config.seed] = async_train.Task(config)
        numbers = placeholder(key) if runner.dry_run else None
        record = train(tasks[config.seed], numbers)
        defaults = default.get_config().to_dict()
        fields = {k: v for k, v in config.to_dict().items() if defaults.get(k) != v or k == "seed"}
        payload = config.async_sim.get("bytes_per_message", 0)
        record.update(
            seed=config.seed,
            config=json.loads(json.dumps(fields, default=str)),
            schedule=describe_schedule(config),
            epochs=config.num_steps * config.num_nodes * config.batch_size / 8000,
            # Per node and step: AD-PSGD sends 2 models per iteration, n iterations per
            # step; D-PSGD sends its model to each of its neighbours.
            bytes_per_node_per_step=config.async_sim.messages_per_step * payload,
            key=key,
            code=runner.code,
        )
        record["bytes_per_node_total"] = record["bytes_per_node_per_step"] * record["steps"]
        runner.cache[key] = record
        runner.save("ad_psgd", method, config.seed, record)
    if key not in runner.study_keys:
        runner.study_keys.add(key)
        runner.trained_seconds += record["wall_clock_s"]
    entry = dict(record, study="ad_psgd", method=method)
    runner.entries.append(entry)
    return entry


def _cell(records, field="final_test_loss") -> str:
    values = [r[field] for r in records]
    return (
        f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"
    )


def mixing_rows(quick: bool) -> str:
    """Theorem 5's mixing quantities of each graph and speed setting."""
    rows = []
    for graph, make in GRAPHS.items():
        topo = make()
        for speed, s in SPEEDS.items():
            w = async_sim.expected_mixing_matrix(topo, s)
            gap = async_sim.spectral_gap(w)
            schedule = async_sim.ad_psgd_schedule(
                topo, 2000 if quick else 20000, max_delay=MAX_DELAY, speeds=s, delays="speeds"
            )
            windows = async_sim.window_mixing_times(schedule, starts=np.arange(0, 1000, 5))
            windows = windows[windows > 0]
            rows.append(
                f"| {graph} | {speed} | {gap:.4f} | {async_sim.mixing_time(w)} | "
                f"{async_sim.mixing_time_bound(gap, 8)} | {int(np.median(windows))} | "
                f"{int(np.percentile(windows, 99))} | {int(windows.max())} | "
                f"{schedule.delay.mean():.1f} | {schedule.delay.max()} |"
            )
    return "\n".join(rows)


def ad_psgd(runner: Runner, docs: str) -> str:
    """AD-PSGD and Moniqua on AD-PSGD (exact simulation) against synchronous D-PSGD."""
    del docs
    tasks: dict = {}
    d = 12298  # the 1-D CNN's parameters (EXPERIMENTS.md, moniqua study)
    seeds = range(runner.seeds)
    rows, results = [], {}
    # CI's smoke test (--quick): the ring only, 7 runs instead of 14.
    graphs = list(GRAPHS.items())[:1] if runner.quick else GRAPHS.items()
    for graph, make in graphs:
        topo = make()
        degree = int(topo.degree)
        sync = [
            _run(
                runner,
                tasks,
                f"{SYNC}, {graph}",
                _config(
                    runner,
                    seed,
                    algorithm="dpsgd",
                    graph=str(topo),
                    messages_per_step=degree,
                    bytes_per_message=4 * d,
                ),
                lambda task, numbers, topo=topo: async_train.train_sync(
                    task, topo, task_steps(runner), placeholder=numbers
                ),
            )
            for seed in seeds
        ]
        for speed, s in SPEEDS.items():
            results[graph, speed, SYNC] = sync
            rows.append(
                f"| {graph} | {speed} | {SYNC} | {fmt(sync)} | {_cell(sync)} | "
                f"{_cell(sync, 'final_train_loss')} | {np.mean([r['max_neighbour_gap'] for r in sync]):.3f} | "
                f"{sync[0]['bytes_per_node_per_step']:,.0f} |"
            )
            for method, comp in METHODS.items():
                payload = 4 * d if comp is None else comp.wire_bytes(d)
                records = [
                    _run(
                        runner,
                        tasks,
                        f"{method}, {graph}, {speed} speeds",
                        _config(
                            runner,
                            seed,
                            algorithm="ad_psgd",
                            graph=str(topo),
                            speeds=str(s),
                            compressor=str(comp),
                            max_delay=MAX_DELAY,
                            delays="speeds",
                            messages_per_step=2,
                            bytes_per_message=payload,
                        ),
                        lambda task, numbers, topo=topo, s=s, comp=comp, seed=seed: (
                            async_train.train_async(
                                task,
                                topo,
                                task_steps(runner),
                                speeds=s,
                                compressor=comp,
                                max_delay=MAX_DELAY,
                                seed=seed,
                                placeholder=numbers,
                            )
                        ),
                    )
                    for seed in seeds
                ]
                results[graph, speed, method] = records
                rows.append(
                    f"| {graph} | {speed} | {method} | {fmt(records)} | {_cell(records)} | "
                    f"{_cell(records, 'final_train_loss')} | "
                    f"{np.mean([r['max_neighbour_gap'] for r in records]):.3f} | "
                    f"{records[0]['bytes_per_node_per_step']:,.0f} |"
                )
    table = "\n".join(rows)
    steps = task_steps(runner)
    return f"""## Seed 003, section 5: AD-PSGD and Moniqua on AD-PSGD, simulated exactly

`lpdec.async_sim` runs AD-PSGD as Theorem 5 counts it: each iteration ONE worker i
(drawn with probability proportional to its speed) applies ONE gradient, computed at
the model it held tau iterations earlier, and averages with ONE neighbour j drawn
uniformly from its neighbours (Lian et al. 2017b): x_i, x_j <- (x_i + x_j)/2 in full
precision, x_i <- x_i + (x^_(j|i) - x^_(i|i))/2 (and symmetrically for j) through
`lpdec.modulo` for Moniqua (stochastic rounding, seed 003's). The delay of an update is
the number of iterations the other workers completed while it computed its gradient
(it read its model right after its previous update), capped at tau_max = {MAX_DELAY}: with
equal speeds it averages about 7, with unequal speeds the slow workers' about 19.
Graphs: the 8-node ring, and "complete (random edge)": the peer uniform among the 7
others, so each iteration is a random edge of the complete graph. Speeds: all equal, or
1 for workers 0-3 and 1/4 for workers 4-7 (the slow ones then make 1/5 of the updates;
AD-PSGD then minimises sum_i p_i f_i, the fast workers' data weighing more, a bias the
IID data here cannot show).
Recipe: seed 003's (`seed003_config`: MNIST-1D IID, the 1-D CNN, batch 32, heavy-ball
momentum 0.9 and weight decay 5e-4 applied to the stale gradient per worker,
{describe_schedule(_config(runner, 0))} counted in synchronous steps),
but SHORTER than the other studies: {steps} synchronous steps = {steps * 8} AD-PSGD
iterations (the same {steps * 8} gradients; the lr decays at 50% and 75% of them),
because a gradient inside the simulator's scan costs about 7 ms on this shared 2-core
machine and the study had to fit 40 minutes. Synchronous D-PSGD (x+ = W x - alpha d,
W the graph's, uniform 1/3 on the ring and exact averaging 1/8 on the complete graph)
runs in the same harness with the same minibatch draws; speeds do not change it (at
equal gradients it only waits longer), so its row repeats. {runner.seeds} seed(s);
mean ± std of the averaged model's final test accuracy and test loss; train loss of the
averaged model on 2,000 training sequences; the largest elementwise neighbour gap at the
end (what theta must exceed); bytes per node per synchronous step (AD-PSGD: 2 models
per iteration, 8 iterations per step, over 8 nodes).

| graph | speeds | method | test accuracy (%) | test loss | train loss | max neighbour gap | bytes / node / step |
|---|---|---|---|---|---|---|---|
{table}

| claim | graph, speeds: difference in test accuracy (points) | verdict |
|---|---|---|
{claims(results)}

Theorem 5's condition on t_mix. The theorem asks that for every k the product of
t_mix consecutive W_k bring every distribution within l1 distance 1/2 of uniform
(TV 1/4). Columns: the spectral gap 1 - |lambda_2| of E[W_k] (edges drawn as above);
t_mix of E[W_k] (smallest t with max_i ||E[W]^t e_i - 1/n||_1 <= 1/2, in iterations,
`async_sim.mixing_time`; by Jensen a lower bound on the realised constant); the bound
ceil(log(sqrt(n)/(1/2)) / gap) that the spectral gap implies; and, over 200 windows of
a schedule drawn with these settings (starts every 5 iterations), the realised
smallest t for which the window's product meets the condition
(`async_sim.window_mixing_times`): median, 99th percentile and maximum. The condition
"for any k" holds with high probability only: a random schedule has no worst-case
bound, the maximum is over the windows measured. Delays: mean and max of that schedule.

| graph | speeds | spectral gap of E[W] | t_mix of E[W] | gap bound | realised t: median | 99% | max | mean delay | max delay |
|---|---|---|---|---|---|---|---|---|---|
{mixing_rows(runner.quick)}
"""


def claims(results: dict) -> str:
    """Verdict rows: each method's mean accuracy minus its reference's, per setting."""
    fp32, m8, m4 = METHODS

    def row(claim, method, reference, within=1.0):
        diffs = {
            (graph, speed): accuracy(results[graph, speed, method])[0]
            - accuracy(results[graph, speed, reference])[0]
            for graph in GRAPHS
            for speed in SPEEDS
            if (graph, speed, method) in results  # a quick run trains the ring only
        }
        text = "; ".join(f"{g}, {s.split(' ')[0]}: {d:+.1f}" for (g, s), d in diffs.items())
        worst = min(diffs.values())
        verdict = (
            f"agrees (no setting more than {within:g} point below)"
            if worst >= -within
            else f"does not agree (worst {worst:+.1f})"
        )
        return f"| {claim} | {text} | {verdict} |"

    return "\n".join(
        [
            row("Moniqua on AD-PSGD (8 bits) keeps AD-PSGD's accuracy (Theorem 5)", m8, fp32),
            row("... at 4 bits", m4, fp32),
            row(
                "AD-PSGD matches synchronous D-PSGD at equal gradients (Lian et al. 2017b)",
                fp32,
                SYNC,
            ),
        ]
    )


def task_steps(runner: Runner) -> int:
    """Synchronous steps per run (x 8 iterations for AD-PSGD)."""
    return QUICK_STEPS if runner.quick else STEPS
