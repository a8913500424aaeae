"""Reproduce the seeds' claims at small scale; writes EXPERIMENTS.md and docs/*.png.

    python -m bench.experiments all            # every study (about 30 min on 2 CPU cores)
    python -m bench.experiments table2 qgm     # some studies
    python -m bench.experiments all --quick    # a few steps, one seed (the test's mode)

Studies (each rewrites its own section of EXPERIMENTS.md):

  table2       seed 002 Table 2 analog: 8-node directed ring and 16-node torus,
               skew 0/0.4/0.8/0.9, no compression and 99% top-k, Deep-Squeeze
               (Sparse-Push) and CHOCO (Quant-SGP), fp32 and 8-bit training.
  qgm          seed 002 Table 3: CHOCO with and without quasi-global momentum.
  moniqua      seed 003: D-PSGD fp32 vs naive 8-bit vs CHOCO / DCD 8-bit vs
               Moniqua 8/4/2/1 bit; accuracy against bytes sent.
  theorem1     seed 003 Theorem 1 on a quadratic: naive quantized gossip stalls,
               Moniqua and CHOCO do not.
  centralized  seeds 001/004: fp32 all-reduce vs two-round 8-bit vs hierarchical
               8-bit on a 2 x 4 mesh.
  tradeoff     accuracy against bytes per node and against simulated wall-clock
               time (link model below) for the main methods (reuses the moniqua
               and centralized runs).

Everything runs on MNIST-1D (10,000 sequences generated locally) with the 1-D
CNN, 8 simulated CPU devices, through `train.train_and_evaluate`. Results are
mean +- std over seeds (3 unless --seeds). Compiled programs are cached on disk
(`runs/jax_cache`), so repetitions that differ only in seed or skew compile once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from bench import _sections  # noqa: E402
from configs import default  # noqa: E402

STUDIES = ("table2", "qgm", "moniqua", "theorem1", "centralized", "tradeoff")
# Link model of the simulated wall clock (study "tradeoff").
BANDWIDTH_BITS_PER_S = 100e6
LATENCY_S = 1e-3


class Runner:
    """Runs configs through train.train_and_evaluate and keeps their records."""

    def __init__(self, quick: bool, seeds: int, workdir: str):
        self.quick = quick
        self.seeds = 1 if quick else seeds
        self.workdir = workdir
        self.records: dict[str, dict] = {}
        self.study_runs = 0
        self.study_seconds = 0.0
        os.makedirs(workdir, exist_ok=True)
        results = os.path.join(workdir, "results.json")
        if os.path.exists(results):
            with open(results) as f:
                self.records = json.load(f)

    def base(self) -> object:
        config = default.get_config()
        config.dataset = "mnist1d"
        config.num_samples = 10000
        config.model = "cnn1d"
        config.num_steps = 20 if self.quick else 200
        config.log_every = 10 if self.quick else 50
        config.lr_schedule = "cosine"
        # The paper's initial rate; a one-seed check at 0.2 found 8-bit training
        # 10-20 points behind 32-bit (it is within 1 point at 0.1).
        config.learning_rate = 0.1
        config.checkpoint_every = 0
        config.eval_local_examples = 500
        return config

    def run(self, tag: str, seed: int, **overrides) -> dict:
        """One training run; cached by (tag, seed) in results.json of the workdir."""
        key = f"{tag}|seed={seed}|quick={self.quick}"
        if key in self.records:
            self.study_runs += 1
            self.study_seconds += self.records[key]["seconds"]
            return self.records[key]
        config = self.base()
        config.seed = seed
        for field, value in overrides.items():
            setattr(config, field, value)
        run_dir = os.path.join(self.workdir, "tmp_run")
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.time()
        summary = train.train_and_evaluate(config, run_dir)
        with open(os.path.join(run_dir, "metrics.csv")) as f:
            header, *rows = [line.strip().split(",") for line in f if line.strip()]
        history = [dict(zip(header, map(float, row), strict=True)) for row in rows]
        record = {
            "final": summary["final"],
            "history": history,
            "wire_bytes_per_step": summary["final"].get("wire_bytes_per_step", 0.0),
            "collectives_per_step": summary.get("collectives_per_step") or 0.0,
            "bytes_by_axis": summary.get("wire_bytes_by_axis") or {},
            "seconds": time.time() - started,
        }
        shutil.rmtree(run_dir, ignore_errors=True)
        self.records[key] = record
        self.study_runs += 1
        self.study_seconds += record["seconds"]
        with open(os.path.join(self.workdir, "results.json"), "w") as f:
            json.dump(self.records, f)
        print(
            f"  {tag} seed {seed}: acc {record['final']['test_accuracy_avg_model']:.3f} "
            f"({record['seconds']:.1f} s)",
            flush=True,
        )
        return record

    def repeat(self, tag: str, **overrides) -> list[dict]:
        return [self.run(tag, seed, **overrides) for seed in range(self.seeds)]


def accuracy(records) -> tuple[float, float]:
    values = 100 * np.array([r["final"]["test_accuracy_avg_model"] for r in records])
    return float(values.mean()), float(values.std())


def fmt(records) -> str:
    mean, std = accuracy(records)
    return f"{mean:.1f} ± {std:.1f}"


# ----------------------------------------------------------------------------
# Studies. Each returns the markdown of its section.
# ----------------------------------------------------------------------------

TABLE2_SETTINGS = [
    # (label, num_nodes, topology)
    ("directed ring, 8 nodes", 8, "directed_ring"),
    ("torus 4x4, 16 nodes", 16, "torus"),
]
SKEWS = (0.0, 0.4, 0.8, 0.9)


def table2(runner: Runner, docs: str) -> str:
    # gamma for 99% top-k from a one-seed sweep (CHOCO: 0.02/0.05/0.1, DS: 0.01/0.02/0.05).
    compressions = {
        "0%": {
            "DS": dict(compressor="identity", gamma=1.0),
            "CHOCO": dict(compressor="identity", gamma=1.0),
        },
        "99%": {
            "DS": dict(compressor="top_k", ratio=0.01, gamma=0.02),
            "CHOCO": dict(compressor="top_k", ratio=0.01, gamma=0.1),
        },
    }
    algorithms = {"DS": "sparse_push", "CHOCO": "quant_sgp"}
    precisions = {"32-bit": "fp32", "8-bit": "int8"}
    settings = TABLE2_SETTINGS[:1] if runner.quick else TABLE2_SETTINGS
    skews = SKEWS[::3] if runner.quick else SKEWS
    cells = {}
    rows = []
    for label, nodes, topology in settings:
        for comp_label, comp in compressions.items():
            for skew in skews:
                line = [label, comp_label, f"{skew:g}"]
                for alg_label, algorithm in algorithms.items():
                    for prec_label, precision in precisions.items():
                        tag = (
                            f"table2|{topology}|{nodes}|{comp_label}|{skew}|{algorithm}|{precision}"
                        )
                        records = runner.repeat(
                            tag,
                            num_nodes=nodes,
                            topology=topology,
                            torus_rows=4 if topology == "torus" else 0,
                            algorithm=algorithm,
                            precision=precision,
                            skew=skew,
                            log_every=runner.base().num_steps,
                            **comp[alg_label],
                        )
                        cells[(label, comp_label, skew, alg_label, prec_label)] = accuracy(records)[
                            0
                        ]
                        line.append(fmt(records))
                rows.append("| " + " | ".join(line) + " |")
    header = (
        "| graph | compression | skew | DS 32-bit | LP-DS 8-bit | CHOCO 32-bit | LP-CHOCO 8-bit |\n"
        "|---|---|---|---|---|---|---|"
    )
    claims = _table2_claims(cells, settings, skews, compressions)
    _plot_table2(cells, settings, skews, compressions, os.path.join(docs, "table2.png"))
    return f"""## Seed 002, Table 2 analog: skew, compression, 8-bit training, DS vs CHOCO

Test accuracy (%) of the node-averaged model, mean ± std over {runner.seeds} seed(s).
MNIST-1D, 1-D CNN (EvoNorm-S0 for 32-bit, Range EvoNorm-S0 for 8-bit), batch 32
per node, Nesterov 0.9, lr 0.1 with cosine decay, weight decay 1e-4,
{runner.base().num_steps} steps (about 6 epochs on 8 nodes). DS = Sparse-Push (Deep-Squeeze with push-sum),
CHOCO = Quant-SGP (CHOCO-SGD with push-sum), as in the paper's experiments;
99% = layer-wise top-1% (gamma 0.02 for DS, 0.1 for CHOCO, each the best of a
one-seed sweep of three values; 1.0 without compression). The 16-node torus runs
2 simulated nodes per CPU device.

{header}
{chr(10).join(rows)}

![Table 2 analog](docs/table2.png)

{claims}
"""


def _table2_claims(cells, settings, skews, compressions) -> str:
    def gaps(compression):
        return [
            cells[(s[0], compression, k, a, "32-bit")] - cells[(s[0], compression, k, a, "8-bit")]
            for s in settings
            for k in skews
            for a in ("DS", "CHOCO")
        ]

    lines = ["| paper's claim (seed 002) | what we measured | verdict |", "|---|---|---|"]
    plain = gaps("0%")
    within = sum(abs(g) <= 1.0 for g in plain)
    lines.append(
        f"| 8-bit training is within ~1% of 32-bit (no compression) | within 1 point in {within} of "
        f"{len(plain)} cells; 32-bit minus 8-bit: mean {np.mean(plain):+.2f}, from "
        f"{min(plain):+.2f} to {max(plain):+.2f} points | "
        + (
            "agrees"
            if within >= 0.75 * len(plain)
            else "agrees on average; single cells scatter by a few points (seed std up to ~5)"
            if abs(np.mean(plain)) <= 1.5
            else "does not agree"
        )
        + " |"
    )
    high = [
        cells[(s[0], "0%", skews[-1], a, "8-bit")] - cells[(s[0], "0%", skews[-1], a, "32-bit")]
        for s in settings
        for a in ("DS", "CHOCO")
    ]
    lines.append(
        f"| 8-bit slightly better than 32-bit at skew 0.9 without compression (+0.56 / +0.83 for "
        f"LP-CHOCO on ResNet-20) | 8-bit minus 32-bit at skew {skews[-1]:g}: "
        f"{', '.join(f'{h:+.1f}' for h in high)} | {'agrees' if np.mean(high) > 0 else 'does not agree'} |"
    )
    if "99%" in compressions:
        squeezed = gaps("99%")
        lines.append(
            f"| ... and 1-2% worse than 32-bit with 99% compression | 32-bit minus 8-bit: mean "
            f"{np.mean(squeezed):+.2f} points (from {min(squeezed):+.2f} to {max(squeezed):+.2f}) | "
            f"{'agrees' if np.mean(squeezed) <= 3 else 'does not agree'} |"
        )
    falls, total = 0, 0
    for s in settings:
        for c in compressions:
            for a in ("DS", "CHOCO"):
                for p in ("32-bit", "8-bit"):
                    series = [cells[(s[0], c, k, a, p)] for k in skews]
                    total += 1
                    falls += series[-1] < series[0]
    lines.append(
        f"| accuracy falls as skew rises | skew {skews[-1]:g} below skew {skews[0]:g} in {falls} "
        f"of {total} series | {'agrees' if falls == total else 'partly'} |"
    )
    if "99%" in compressions and len(skews) > 1:

        def cost(skew):
            return np.mean(
                [
                    cells[(s[0], "0%", skew, a, p)] - cells[(s[0], "99%", skew, a, p)]
                    for s in settings
                    for a in ("DS", "CHOCO")
                    for p in ("32-bit", "8-bit")
                ]
            )

        low, high_cost = cost(skews[0]), cost(skews[-1])
        lines.append(
            f"| compression costs 1-2% more at high skew | 99% top-k costs {low:.1f} points at skew "
            f"{skews[0]:g} and {high_cost:.1f} at skew {skews[-1]:g} (mean over cells): more at high "
            f"skew, but ~30 points rather than 1-2 | partly |"
            if high_cost > low
            else f"| compression costs 1-2% more at high skew | {low:.1f} points at skew {skews[0]:g}, "
            f"{high_cost:.1f} at skew {skews[-1]:g} | does not agree |"
        )
    if "99%" in compressions:
        pairs = [
            (cells[(s[0], "99%", k, "CHOCO", p)], cells[(s[0], "99%", k, "DS", p)])
            for s in settings
            for k in skews
            for p in ("32-bit", "8-bit")
        ]
        wins = sum(a > b for a, b in pairs)
        lines.append(
            f"| CHOCO >= Deep-Squeeze | with 99% top-k CHOCO is ahead in {wins} of {len(pairs)} cells, "
            f"by {np.mean([a - b for a, b in pairs]):+.1f} points on average; without compression "
            f"(gamma = 1, identity) the two are the same algorithm and tie exactly | "
            f"{'agrees' if wins >= 0.75 * len(pairs) else 'partly'} |"
        )
    return "\n".join(lines) + TABLE2_DISCUSSION


TABLE2_DISCUSSION = """

Why it looks this way. Without compression (and gamma = 1) Sparse-Push and
Quant-SGP reduce to the same update, x+ = W (x + u), so their columns match to
the last digit. 8-bit training tracks 32-bit training within a few points
without compression and is ahead at skew 0.9 in most cells, like the paper's
regularisation observation. With layer-wise top-1%, the gap to the paper is
large: the 1-D CNN has 12k parameters, so top-1% keeps 1 to 51 entries per
layer, and 200 steps do not let error feedback catch up; 8-bit training
suffers most there (per-tensor 8-bit weights hide the many small, sparse
updates below a tensor's quantization unit; a hypothesis we did not isolate).
The paper's 99% results are on 0.27M-9.5M-parameter models over 200 epochs.
"""


def _plot_table2(cells, settings, skews, compressions, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for c in compressions:
            for a in ("DS", "CHOCO"):
                for p in ("32-bit", "8-bit"):
                    ys = [cells[(setting[0], c, k, a, p)] for k in skews]
                    ax.plot(
                        skews,
                        ys,
                        marker="o",
                        linestyle="-" if p == "32-bit" else "--",
                        label=f"{a} {p} {c}",
                    )
        ax.set_title(setting[0])
        ax.set_xlabel("degree of skew")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def qgm(runner: Runner, docs: str) -> str:
    """Seed 002 Table 3: CHOCO (Quant-SGP) with and without quasi-global momentum."""
    skews = (0.0, 0.9) if not runner.quick else (0.9,)
    rows, cells = [], {}
    for skew in skews:
        line = [f"{skew:g}"]
        for opt_label, optimizer in (("local Nesterov", "nesterov"), ("QGM", "qg_momentum")):
            for prec_label, precision in (("32-bit", "fp32"), ("8-bit", "int8")):
                records = runner.repeat(
                    f"qgm|{skew}|{optimizer}|{precision}",
                    topology="directed_ring",
                    algorithm="quant_sgp",
                    compressor="identity",
                    optimizer=optimizer,
                    precision=precision,
                    skew=skew,
                    log_every=runner.base().num_steps,
                )
                cells[(skew, opt_label, prec_label)] = accuracy(records)[0]
                line.append(fmt(records))
        rows.append("| " + " | ".join(line) + " |")
    gains = {
        skew: np.mean(
            [
                cells[(skew, "QGM", p)] - cells[(skew, "local Nesterov", p)]
                for p in ("32-bit", "8-bit")
            ]
        )
        for skew in skews
    }
    verdict = "agrees" if gains[skews[-1]] > 0 else "does not agree"
    return f"""## Seed 002, Table 3 analog: quasi-global momentum

CHOCO (Quant-SGP) on the 8-node directed ring without compression, with local
Nesterov momentum or quasi-global momentum (`lpdec.qg_momentum`, Nesterov form),
32- and 8-bit training; otherwise as the Table 2 analog. Test accuracy (%).

| skew | CHOCO 32-bit | LP-CHOCO 8-bit | CHOCO + QGM 32-bit | LP-CHOCO + QGM 8-bit |
|---|---|---|---|---|
{chr(10).join(rows)}

| paper's claim | what we measured | verdict |
|---|---|---|
| QGM improves accuracy under high skew (seed 002: +1-2 points at skew 0.9, Table 3 vs Table 2) | QGM minus local momentum: {", ".join(f"{gains[k]:+.2f} points at skew {k:g}" for k in skews)} (mean of 32/8-bit) | {verdict} |

Why it may not agree. `lpdec.qg_momentum` follows Lin et al. (2021, Alg. 1,
Nesterov form: m = g + beta m_hat, step g + beta m, then m_hat <- mu m_hat +
(1 - mu) (x_prev - x) / lr with mu = beta = 0.9); it matches a float64
reimplementation of those formulas step by step (tests/test_dcd_qgm_mean.py),
and the update agrees with the authors' public code (read, not copied). A
one-seed check rules out the schedule: with a constant learning rate QGM is
also far behind at skew 0.9 (38.9% vs 68.5%). Our guess: the QG buffer
averages model differences that include the consensus drift, which dominates
the gradient step early in training on skewed data; 200 steps end before the
buffer settles, and the paper's runs last 200 epochs. Not reproduced here.
"""


MONIQUA_METHODS = {
    # label: train.py overrides (8-node undirected ring, IID)
    "D-PSGD fp32": dict(algorithm="dpsgd", compressor="identity"),
    "naive 8-bit": dict(
        algorithm="naive_quantized", compressor="minmax", bits=8, rounding="stochastic"
    ),
    "CHOCO 8-bit": dict(
        algorithm="choco", compressor="minmax", bits=8, rounding="stochastic", gamma=1.0
    ),
    "DCD 8-bit": dict(algorithm="dcd", compressor="minmax", bits=8, rounding="stochastic"),
    "Moniqua 8-bit": dict(algorithm="moniqua", bits=8, theta=0.1, theta_follows_lr=True),
    "Moniqua 4-bit": dict(algorithm="moniqua", bits=4, theta=0.1, theta_follows_lr=True),
    "Moniqua 2-bit": dict(algorithm="moniqua", bits=2, theta=0.1, theta_follows_lr=True),
    "Moniqua 1-bit (slack 0.1)": dict(
        algorithm="moniqua", bits=1, theta=0.1, slack=0.1, theta_follows_lr=True
    ),
}


def moniqua(runner: Runner, docs: str) -> str:
    """Seed 003: Moniqua against the baselines at several bit budgets."""
    methods = dict(list(MONIQUA_METHODS.items())[::3]) if runner.quick else MONIQUA_METHODS
    results = {
        label: runner.repeat(f"moniqua|{label}", topology="ring", **kw)
        for label, kw in methods.items()
    }
    base = accuracy(results["D-PSGD fp32"])[0]
    rows = []
    for label, records in results.items():
        wire = records[0]["wire_bytes_per_step"]
        total = wire * records[0]["history"][-1]["step"]
        rows.append(
            f"| {label} | {fmt(records)} | {accuracy(records)[0] - base:+.1f} | {wire:,.0f} | {total / 1e6:.2f} |"
        )
    _plot_accuracy_vs_bytes(
        results, os.path.join(docs, "moniqua_bytes.png"), "8-node ring (seed 003 methods)"
    )
    claims = []
    if "Moniqua 8-bit" in results and "naive 8-bit" in results:
        m8, naive = accuracy(results["Moniqua 8-bit"])[0], accuracy(results["naive 8-bit"])[0]
        claims.append(
            f"| Moniqua matches full-precision D-PSGD at 8 bits | {m8:.1f} vs {base:.1f} | "
            f"{'agrees' if abs(m8 - base) <= 1.5 else 'does not agree'} |"
        )
        claims.append(
            f"| naive quantization hurts (Theorem 1) | naive 8-bit {naive:.1f} vs D-PSGD {base:.1f} | "
            f"{'agrees' if naive < base - 0.5 else 'not visible at this scale'} |"
        )
    low = [label for label in results if "1-bit" in label or "2-bit" in label]
    if low:
        text = ", ".join(f"{label} {accuracy(results[label])[0]:.1f}" for label in low)
        worst = min(accuracy(results[label])[0] for label in low)
        claims.append(
            f"| Moniqua is robust to very low bit budgets (1 bit without losing accuracy) | {text} "
            f"(D-PSGD {base:.1f}) | {'agrees' if worst >= base - 2 else 'does not agree'} |"
        )
    return f"""## Seed 003: Moniqua against the baselines

8-node undirected ring (W = 1/3), IID data, otherwise as the Table 2 analog.
Compressed methods use stochastic rounding, as in seed 003's experiments.
Moniqua's a-priori bound theta follows the learning rate (theta_k = 0.1 lr_k /
lr_0, Theorem 2's theta proportional to the step size); 1 bit uses the slack
matrix 0.1 W + 0.9 I (Theorem 3). Bytes: per node per step (compiled program)
and over the whole run.

| method | test accuracy (%) | vs D-PSGD | bytes / node / step | MB / node in total |
|---|---|---|---|---|
{chr(10).join(rows)}

![accuracy against bytes](docs/moniqua_bytes.png)

| paper's claim (seed 003) | what we measured | verdict |
|---|---|---|
{chr(10).join(claims)}

Why. Moniqua at 8 and 4 bits does what the paper says: full-precision
accuracy at a quarter and an eighth of D-PSGD's bytes. Naive 8-bit gossip is
close to D-PSGD on this network: its floor (Theorem 1, shown on the quadratic
below) sits under the gradient noise of 200 steps of SGD here. At 1 bit the
decoded neighbour difference can only be 0 or +-2 theta (nearest rounding on
a 2-point circle), which carries little of the models; a one-seed sweep of
the slack (0.1, 0.01, 0.005) and theta (0.02 to 0.5) stayed at 38-45%, about
what nodes training alone reach. The paper's 1-bit result (ResNet-20 on
CIFAR-10, slack 5e-3, far longer training) is not reproduced at this scale.
"""


def _plot_accuracy_vs_bytes(results, path, title, wall=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, records in results.items():
        steps = np.array([row["step"] for row in records[0]["history"]])
        accs = 100 * np.mean(
            [[row["test_accuracy_avg_model"] for row in r["history"]] for r in records], axis=0
        )
        if wall is None:
            xs = steps * records[0]["wire_bytes_per_step"] / 1e6
        else:
            xs = steps * wall[label]
        ax.plot(np.maximum(xs, 1e-3), accs, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per node" if wall is None else "simulated wall-clock time (s)")
    ax.set_ylabel("test accuracy of the averaged model (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def theorem1(runner: Runner, docs: str) -> str:
    """Seed 003 Theorem 1: gradient norm of the averaged model on a quadratic."""
    import jax.numpy as jnp
    import optax

    import lpdec

    n, d = 8, 64
    steps = 60 if runner.quick else 3000
    rng = np.random.default_rng(0)
    b = rng.uniform(-1, 1, (n, d)).astype(np.float32)  # f_i(x) = |x - b_i|^2 / 2
    x_star = b.mean(axis=0)
    ring = lpdec.ring(n)
    lr = 0.05
    methods = {
        "naive quantized 8-bit": lpdec.naive_quantized(ring, lpdec.minmax(8, "stochastic")),
        "Moniqua 8-bit": lpdec.moniqua(ring, bits=8, theta=lambda t: 2.0 / (1.0 + t / 100.0)),
        "CHOCO 8-bit": lpdec.choco(ring, lpdec.minmax(8, "stochastic"), gamma=1.0),
        "D-PSGD fp32": lpdec.dpsgd(ring),
    }
    curves = {}
    for label, algorithm in methods.items():
        schedule = lambda t: lr / (1.0 + t / 100.0)  # noqa: E731
        tx = optax.chain(optax.sgd(schedule), algorithm)

        def node(x, b_i, tx=tx):
            state = tx.init(x)

            def body(carry, _):
                x, state = carry
                updates, state = tx.update(x - b_i, state, x)
                x = optax.apply_updates(x, updates)
                return (x, state), x

            _, xs = jax.lax.scan(body, (x, state), None, length=steps)
            return xs

        xs = jax.jit(jax.vmap(node, axis_name="nodes"))(jnp.zeros((n, d)), jnp.asarray(b))
        average = np.asarray(xs, np.float64).mean(axis=0)  # [steps, d]
        # f(x) = mean_i f_i(x): grad f(x_bar) = x_bar - x*.
        curves[label] = ((average - x_star) ** 2).sum(axis=1)
    _plot_theorem1(curves, os.path.join(docs, "theorem1.png"))
    rows = [
        f"| {label} | {c[steps // 10]:.2e} | {c[steps // 2]:.2e} | {c[-1]:.2e} |"
        for label, c in curves.items()
    ]
    naive = curves["naive quantized 8-bit"]
    stalls = naive[-1] > 0.3 * naive[steps // 2]
    others = all(curves[k][-1] < 0.1 * naive[-1] for k in curves if k != "naive quantized 8-bit")
    return f"""## Seed 003, Theorem 1: naive quantized gossip stalls

A quadratic with a different optimum per node, f_i(x) = |x - b_i|^2 / 2 with
b_i uniform in [-1, 1]^64, 8-node ring, step size 0.05 / (1 + t / 100),
{steps} iterations. The squared gradient norm of the global objective at the
averaged model, |grad f(x_bar)|^2 = |x_bar - x*|^2:

| method | at {steps // 10} | at {steps // 2} | at {steps} |
|---|---|---|---|
{chr(10).join(rows)}

![Theorem 1](docs/theorem1.png)

| paper's claim (seed 003, Theorem 1) | what we measured | verdict |
|---|---|---|
| gossiping Q(x) directly stalls at a floor whatever the step size; Moniqua (and error-compensated methods such as CHOCO) keep converging | naive: {naive[steps // 2]:.1e} -> {naive[-1]:.1e} while the step size halves again; the others end {", ".join(f"{k} {curves[k][-1]:.1e}" for k in curves if k != "naive quantized 8-bit")} | {"agrees" if stalls and others else "does not agree"} |

The floor comes from the model's own range: min-max quantization of x_j (range
about 2 here) has a unit of 2/255, and that noise enters every step at full
size, while CHOCO quantizes the difference to a public copy (which shrinks)
and Moniqua quantizes x modulo a bound that shrinks with the step size.
"""


def _plot_theorem1(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, curve in curves.items():
        ax.plot(np.arange(1, len(curve) + 1), curve, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("|grad f(x_bar)|^2")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


CENTRAL_METHODS = {
    "all-reduce fp32": dict(algorithm="allreduce"),
    "two-round 8-bit (QSGD-TF, seed 001)": dict(
        algorithm="compressed_mean", compressor="minmax", bits=8, rounding="stochastic"
    ),
    "hierarchical 8-bit, 2 x 4 (seed 004)": dict(
        algorithm="compressed_mean",
        compressor="minmax",
        bits=8,
        rounding="stochastic",
        devices=2,
        hierarchical=True,
    ),
}


def centralized(runner: Runner, docs: str) -> str:
    """Seeds 001/004: compressed all-reduce of gradients, flat and hierarchical."""
    results = {
        label: runner.repeat(f"central|{label}", **kw) for label, kw in CENTRAL_METHODS.items()
    }
    base = accuracy(results["all-reduce fp32"])[0]

    def across(record):
        # Bytes over the inter-machine axis: everything for the flat methods.
        by_axis = record.get("bytes_by_axis") or {}
        return (
            by_axis.get("nodes", record["wire_bytes_per_step"])
            if len(by_axis) > 1
            else record["wire_bytes_per_step"]
        )

    rows = [
        f"| {label} | {fmt(r)} | {accuracy(r)[0] - base:+.1f} | {r[0]['wire_bytes_per_step']:,.0f} | {across(r[0]):,.0f} |"
        for label, r in results.items()
    ]
    worst = min(accuracy(r)[0] for r in results.values())
    return f"""## Seeds 001 and 004: compressed all-reduce

Every node holds the same model; gradients are averaged by a full-precision
all-reduce, by the two-round 8-bit exchange of seed 001 (scatter-reduce then
all-gather of stochastically rounded 8-bit chunks), or hierarchically (seed
004) on a 2 x 4 layout: 2 "machines" (CPU devices) of 4 nodes each, a
full-precision reduce inside a machine, the 8-bit exchange between machines,
a broadcast inside. IID data, 8 nodes, otherwise as the Table 2 analog. Bytes:
what one node hands to collectives per step (all-reduce: its whole gradient;
compressed: the codes and scales of its chunks); for the hierarchical layout
(counted at trace time) the full-precision traffic inside a machine and the
8-bit traffic between machines are listed apart: only the latter crosses the
slow link.

| method | test accuracy (%) | vs all-reduce | bytes / node / step, all | bytes / node / step between machines |
|---|---|---|---|---|
{chr(10).join(rows)}

| claim (seeds 001 / 004) | what we measured | verdict |
|---|---|---|
| 8-bit gradient exchange converges like full precision at about a quarter of the bytes | all methods within {base - worst:.1f} points of the fp32 all-reduce | {"agrees" if base - worst <= 1.5 else "does not agree"} |
"""


def tradeoff(runner: Runner, docs: str) -> str:
    """Accuracy against bytes and against simulated wall-clock time for the main methods."""
    methods = {}
    for label, kw in MONIQUA_METHODS.items():
        if runner.quick and label not in ("D-PSGD fp32", "CHOCO 8-bit"):
            continue
        methods[label] = runner.repeat(f"moniqua|{label}", topology="ring", **kw)
    for label, kw in list(CENTRAL_METHODS.items())[:2]:
        methods[label] = runner.repeat(f"central|{label}", **kw)
    compute = runner.repeat("tradeoff|compute only", algorithm="none", compressor="identity")
    compute_step = float(np.median([r["final"]["step_time_s"] for r in compute]))
    wall = {}
    rows = []
    for label, records in methods.items():
        nbytes = records[0]["wire_bytes_per_step"]
        collectives = records[0]["collectives_per_step"]
        comm = collectives * LATENCY_S + 8 * nbytes / BANDWIDTH_BITS_PER_S
        wall[label] = compute_step + comm
        final = accuracy(records)[0]
        rows.append(
            f"| {label} | {final:.1f} | {nbytes:,.0f} | {collectives:g} | {1e3 * comm:.1f} | "
            f"{1e3 * wall[label]:.1f} |"
        )
    _plot_accuracy_vs_bytes(
        methods, os.path.join(docs, "tradeoff_bytes.png"), "8 nodes: accuracy vs bytes"
    )
    _plot_accuracy_vs_bytes(
        methods,
        os.path.join(docs, "tradeoff_wallclock.png"),
        "8 nodes, 100 Mbit/s, 1 ms",
        wall=wall,
    )
    return f"""## Accuracy against bytes and against simulated wall-clock time

The main methods on 8 nodes (the Moniqua study's runs on a ring, and the
centralized study's), plotted against the bytes each node sent and against a
simulated wall clock.

Link model: each node has a 100 Mbit/s link with 1 ms latency; a step takes
the measured compute time of a node (a run with no communication on the same
layout: {1e3 * compute_step:.1f} ms per step) plus, for every collective of
the step (one ppermute per edge class for gossip, each all-to-all / all-gather
/ all-reduce for the centralized methods), the latency plus its bytes over
the bandwidth, one after the other. Bytes per collective are what the node
hands to it (compiled program), so an all-reduce counts its whole buffer once
(a ring all-reduce would move 2(n-1)/n of it and pay 2(n-1) latencies: the
model favours all-reduce). Compute does not overlap with communication.

| method | test accuracy (%) | bytes / node / step | collectives / step | communication ms / step | simulated ms / step |
|---|---|---|---|---|---|
{chr(10).join(rows)}

![accuracy against bytes](docs/tradeoff_bytes.png)
![accuracy against simulated time](docs/tradeoff_wallclock.png)
"""


STUDY_FUNCTIONS = {
    "table2": table2,
    "qgm": qgm,
    "moniqua": moniqua,
    "theorem1": theorem1,
    "centralized": centralized,
    "tradeoff": tradeoff,
}


HEADER = """# Experiments: the seeds' claims at small scale

Produced by `python -m bench.experiments all` (see `bench/experiments.py` for
every setting). CIFAR-10 and the NLP sets cannot be downloaded here, so each
study reproduces a claim of seeds 001-004 on MNIST-1D (generated locally) with
a 1-D CNN, on 8 simulated CPU devices of a 2-core machine. Each section was
written by the command in its header and states its own settings; the same
studies run the full-size paper settings through the CIFAR-10 configs
(`configs/cifar10_*.py`) on a machine with the data and a GPU.

Run time: a first, uncached `python -m bench.experiments all` took 39.6 min
on this 2-core machine on 2026-11-22 (table2 31.4, qgm 2.9, moniqua 3.3,
theorem1 0.0, centralized 1.7, tradeoff 0.3). Results are cached by run in
`runs/experiments/results.json`, so rerunning a study only rewrites its
section; each section gives its runs' summed time.
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("studies", nargs="+", choices=STUDIES + ("all",))
    parser.add_argument("--quick", action="store_true", help="few steps, one seed (smoke test)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--output", default=os.path.join(ROOT, "EXPERIMENTS.md"))
    parser.add_argument(
        "--docs", default=None, help="plot directory (default: docs/ beside --output)"
    )
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "experiments"))
    args = parser.parse_args(argv)

    jax.config.update("jax_compilation_cache_dir", os.path.join(ROOT, "runs", "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    docs = args.docs or os.path.join(os.path.dirname(os.path.abspath(args.output)), "docs")
    os.makedirs(docs, exist_ok=True)
    workdir = args.workdir + ("_quick" if args.quick else "")
    runner = Runner(args.quick, args.seeds, workdir)
    studies = STUDIES if "all" in args.studies else args.studies
    for name in studies:
        started = time.time()
        runner.study_runs, runner.study_seconds = 0, 0.0
        print(f"study {name}", flush=True)
        body = STUDY_FUNCTIONS[name](runner, docs)
        minutes = (time.time() - started) / 60
        command = f"python -m bench.experiments {name}" + (" --quick" if args.quick else "")
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        # Runs are cached in the workdir: report their own (first) run time, summed,
        # besides this invocation's wall time.
        timing = f"{minutes:.1f} min wall" + (
            f"; its {runner.study_runs} training runs took {runner.study_seconds / 60:.1f} min"
            if runner.study_runs
            else ""
        )
        body = body.replace(
            "\n", f"\n\n_Command: `{command}`; {timing} on this machine ({stamp})._\n", 1
        )
        _sections.replace_section(args.output, f"study:{name}", body, header=HEADER)
        print(f"study {name} done in {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
