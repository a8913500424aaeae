"""Reproduce the seeds' claims at training length: EXPERIMENTS.md and docs/experiments.json.

Writes EXPERIMENTS.md, docs/experiments.json and the plots docs/*.png:

    python -m bench.experiments all            # every study (see EXPERIMENTS.md for times)
    python -m bench.experiments gamma table2   # some studies
    python -m bench.experiments all --quick    # a few steps, one seed (the test's mode)
    python -m bench.experiments all --render   # tables and plots from docs/experiments.json
    python -m bench.experiments all --dry-run  # every config checked, nothing trained

Studies (each rewrites its own section of EXPERIMENTS.md and its runs in
docs/experiments.json):

  gamma        consensus step sizes at full length: CHOCO (Quant-SGP) and Deep-Squeeze
               (Sparse-Push) with 8-bit and 99% top-k compression on the smallest
               setting; the best gamma of each is used by every other study.
  table2       seed 002 Table 2 analog: 8-node directed ring, skew 0 and 0.9, no
               compression and 99% top-k, Deep-Squeeze and CHOCO, 32- and 8-bit
               training.
  precision    where Table 2's 8-bit gap comes from: 32/8-bit training crossed with
               EvoNorm / Range EvoNorm, on the ring, the torus and an exact mean.
  qgm          seed 002 Table 3: CHOCO with and without quasi-global momentum.
  moniqua      seed 003 at its own hyperparameters: D-PSGD fp32 vs naive 8-bit vs
               CHOCO / DCD 8-bit vs Moniqua 8/4/2/1 bit with stochastic rounding,
               theta = 2.0, and the average ratio 5e-3 at one bit.
  theorem1     seed 003 Theorem 1 on a quadratic: naive quantized gossip stalls,
               Moniqua and CHOCO do not.
  centralized  seeds 001/004: fp32 all-reduce vs two-round 8-bit vs hierarchical
               8-bit on a 2 x 4 mesh.
  tradeoff     accuracy against bytes per node and against simulated wall-clock
               time, IID and at skew 0.9: gossip, all-reduce, and the local-step
               methods (DiLoCo with fp32, 4-bit and 2-bit error-feedback exchanges,
               and DiLoCo over CHOCO gossip).
  ad_psgd      seed 003 section 5: AD-PSGD and Moniqua on AD-PSGD (8 and 4 bits)
               simulated exactly (lpdec.async_sim) against synchronous D-PSGD at
               the same gradients, ring and random edges, equal and unequal speeds,
               with Theorem 5's mixing-time quantities.

Everything runs on MNIST-1D (10,000 sequences generated locally, 8,000 for
training) with the 1-D CNN, 8 simulated CPU devices, through
`train_lib.train_and_evaluate`, for STEPS steps with the papers' step decay.
Results are mean +- std over seeds (3 unless --seeds).

Dry run: `--dry-run` trains nothing. Each run's config is checked as train.py checks
it before its first step (`train_lib.build`; the AD-PSGD runs: everything up to the
simulator's first iteration), and its record holds placeholder numbers derived from
its key, so a study's whole grid, tables and plots are checked in seconds before a
run of hours. It writes to runs/experiments_dry_run/ unless --output says otherwise,
says DRY RUN in every section, and its records are never cached, never read as
cached, and never written into an experiments.json of trained runs.

Caching: every run is stored in `runs/experiments/results.json` under a key made of
its whole config and a fingerprint of the code that trains it (`code_fingerprint`:
train.py, train_lib/, lpdec/ and configs/default.py, comments and docstrings
excluded). A change to that code, or to any field of a run's config, makes the run
train again; studies that share a config share its run. Runs in docs/experiments.json
that the same code trained also count as cached, so a fresh clone can run one
study without retraining the runs it shares with the others.

Modules: `runner` (the recipes and the Runner that trains them through
`train_lib.train_and_evaluate`), `cache` (runs keyed by config and code
fingerprint: the workdir's results.json and docs/experiments.json), one module
per study (its configs, table and figures: `gamma`, `table2`, `precision`, `qgm`,
`moniqua`, `theorem1`, `centralized`, `tradeoff`, `mx`, `ad_psgd`, whose runs
`async_train` trains through `lpdec.async_sim`), `render` (what the sections
share: table cells, figures, EXPERIMENTS.md's header and runtime table) and
`cli` (the command line).
"""

from bench.experiments.cache import CODE
from bench.experiments.cache import ROOT
from bench.experiments.cache import STUDIES
from bench.experiments.cache import code_fingerprint
from bench.experiments.cli import STUDY_FUNCTIONS
from bench.experiments.cli import main
from bench.experiments.precision import norm_collapses
from bench.experiments.render import collapse
from bench.experiments.render import collapsed_seeds
from bench.experiments.render import collapses
from bench.experiments.runner import QUICK_STEPS
from bench.experiments.runner import STEPS
from bench.experiments.runner import Runner
from bench.experiments.runner import describe_schedule
from bench.experiments.runner import seed002_config
from bench.experiments.runner import seed003_config

__all__ = [
    "CODE",
    "QUICK_STEPS",
    "ROOT",
    "Runner",
    "STEPS",
    "STUDIES",
    "STUDY_FUNCTIONS",
    "code_fingerprint",
    "collapse",
    "collapsed_seeds",
    "collapses",
    "describe_schedule",
    "main",
    "norm_collapses",
    "seed002_config",
    "seed003_config",
]
