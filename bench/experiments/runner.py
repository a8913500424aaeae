"""The papers' recipes scaled to MNIST-1D, and the Runner that trains them (or reads them back)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext

from bench.experiments import cache

sys.path.insert(0, cache.ROOT)

import train_lib  # noqa: E402
from configs import default  # noqa: E402
from configs import mnist1d_seed002  # noqa: E402
from configs import mnist1d_seed003  # noqa: E402

# A language model's quality column of metrics.csv (the synchronised model's).
LM_METRIC = "val_bits_per_byte_avg_model"
STEPS = 2000  # per run (about 64 epochs of 8,000 sequences on 8 nodes of batch 32)
QUICK_STEPS = 20
# How often an invocation waiting for another's run (its claim) looks for its record.
CLAIM_POLL_S = 5.0


def _recipe(module, quick: bool):
    config = module.get_config()
    config.num_steps = QUICK_STEPS if quick else STEPS
    config.log_every = config.num_steps // 10
    config.checkpoint_every = 0
    config.eval_local_examples = 500
    return config


def seed002_config(quick: bool):
    """Seed 002's recipe (configs/mnist1d_seed002.py).

    Nesterov 0.9, weight decay 1e-4, lr 0.1, x0.1 at 50% and 75% of the steps.
    """
    return _recipe(mnist1d_seed002, quick)


def seed003_config(quick: bool):
    """Seed 003's recipe (configs/mnist1d_seed003.py): heavy-ball 0.9, wd 5e-4, lr 0.1, ring."""
    return _recipe(mnist1d_seed003, quick)


def placeholder(key: str) -> dict[str, float]:
    """The numbers a dry run (`Runner(dry_run=True)`) puts where a run's results go.

    Derived from the run's key (16 hex digits): the same every time, different from run
    to run, so a dry run's tables show which cell holds which run. They are never
    results: a dry run's records say `dry_run` and are never cached or published as
    trained (see `cache`).
    """
    # Eight hex digits for the accuracy (no two runs of a study share one), four each
    # for the rest.
    u = [int(key[:8], 16) / 0xFFFFFFFF] + [int(key[i : i + 4], 16) / 0xFFFF for i in (8, 12)]
    return {
        "accuracy": 0.1 + 0.8 * u[0],
        "loss": 0.1 + 2.0 * u[1],
        "consensus": u[2],
        "bytes": float(1000 + round(1e5 * u[1])),
        "step_time_s": 1e-3 * (1.0 + u[2]),
        "collectives": float(1 + round(4 * u[2])),
    }


def placeholder_curve(numbers: dict[str, float], points) -> list[list[float]]:
    """[step, accuracy, loss] at `points` (steps): rising to the placeholder accuracy,
    the loss falling to the placeholder loss (so no dry run looks collapsed)."""
    last = points[-1]
    return [
        [step, numbers["accuracy"] * step / last, numbers["loss"] * (2 - step / last)]
        for step in points
    ]


def describe_schedule(config) -> str:
    """The config's learning-rate schedule in words, as the tables state it."""
    lr = config.learning_rate
    if config.lr_schedule == "piecewise":
        cuts = ", ".join(f"{int(f * config.num_steps)}" for f in config.lr_boundaries)
        text = f"lr {lr:g} x{config.lr_decay:g} at steps {cuts}"
    else:
        text = f"lr {lr:g} {config.lr_schedule}"
    if config.warmup_steps:
        text += f", linear warm-up over {config.warmup_steps} steps"
    return text


class Runner:
    """Trains configs through train_lib.train_and_evaluate; keeps their records.

    `repeat(study, method, base, **overrides)` runs the config over the seeds; every
    record used by a study goes into its entries of docs/experiments.json. With
    `replay`, records come from that file instead of training (a missing run is an
    error), so tables and plots can be regenerated from it alone.

    With `dry_run`, nothing trains: each config is checked as train_and_evaluate checks
    it before its first step (`train_lib.build`), and its record holds `placeholder`
    numbers and `dry_run: True`. A dry run reads no cache and writes none, and its
    code is "dry run (<fingerprint>)", which no cached or published run of real code
    can match.
    """

    def __init__(
        self,
        quick: bool,
        seeds: int,
        workdir: str,
        replay: dict[str, dict] | None = None,
        published: str | None = None,
        dry_run: bool = False,
        keep_published: bool = False,
    ):
        self.quick = quick
        self.seeds = 1 if quick else seeds
        self.workdir = workdir
        self.replay = replay
        self.dry_run = dry_run
        self.code = cache.code_fingerprint()
        if dry_run:
            self.code = f"dry run ({self.code})"
        # Set by --train-only: train only methods whose label holds one of these strings;
        # `run` returns None for the others' runs that are not cached yet.
        self.train_only: tuple[str, ...] | None = None
        # In a dry run: the configs checked so far (a config two studies share, once).
        self.cache: dict[str, dict] = {}
        self.entries: list[dict] = []
        self.trained_seconds = 0.0
        self.study_keys: set[str] = set()
        self.cache_path = os.path.join(workdir, "results.json")
        # The claims of the runs invocations sharing this workdir are training now.
        self.claims = os.path.join(workdir, "claims")
        # --keep-published: runs of earlier code that count as cached (below).
        self.kept: dict[str, dict] = {}
        # Every (study, method, seed) the published file lists, with its keys.
        self.listings: dict[tuple, set[str]] = {}
        if dry_run:
            return
        if published and os.path.exists(published):
            self.listings = cache.published_listings(published)
        os.makedirs(workdir, exist_ok=True)
        if replay is None:
            self.cache = cache.load_results(self.cache_path, self.code)
        if replay is None and published and os.path.exists(published):
            # The published records of this very code are as good as a local cache.
            for key, record in cache.published_results(published, self.code).items():
                self.cache.setdefault(key, record)
        # --keep-published: every published run counts, whatever code trained it (each
        # record keeps its own code fingerprint, which the report names), found by its
        # key or, where new config fields changed the key, by its study, method and seed.
        if keep_published and replay is None and published and os.path.exists(published):
            self.kept = {
                k: e for k, e in cache.load_published(published).items() if not e.get("dry_run")
            }
        if keep_published and replay is None:
            # This workdir's runs of earlier code too (other invocations', still going).
            self._keep_workdir()

    def config(self, base, **overrides):
        """The recipe `base` with `overrides`; a field the config lacks is a KeyError."""
        config = base(self.quick)
        for field, value in overrides.items():
            if field not in config:
                raise KeyError(f"unknown config field {field!r}")
            setattr(config, field, value)
        return config

    def key(self, config) -> str:
        """The key the run of `config` is cached and published under."""
        return cache.config_key(config)

    def run(self, study: str, method: str, config, optional: bool = False) -> dict | None:
        """The record of `config` (cached, replayed or trained now), listed under study/method.

        `optional`: a study that grows over several invocations (lm) renders a run the
        json does not hold yet as None (its table says "not run yet"), not as an error.
        """
        key = self.key(config)
        if self.replay is not None:
            # A config that gained fields since (a new configs/default.py field changes
            # every key) is still found by what the json lists it as: its study, method
            # and seed, when those name one run.
            if key not in self.replay:
                key = (
                    self._same_run(config, self.replay)
                    or self._listed(study, method, config.seed)
                    or key
                )
            if key not in self.replay and optional:
                return None
            if key not in self.replay:
                raise SystemExit(
                    f"error: docs/experiments.json has no run of {study} / {method} seed "
                    f"{config.seed} with this config; run the study instead of --render."
                )
            record = self.replay[key]
        else:
            record = self._cached_or_trained(study, method, key, config)
            if record is None:
                return None
        if key not in self.study_keys:  # a run two methods share counts once
            self.study_keys.add(key)
            self.trained_seconds += record["wall_clock_s"]
        entry = dict(record, study=study, method=method)
        self.entries.append(entry)
        return entry

    def _cached_or_trained(self, study: str, method: str, key: str, config) -> dict | None:
        """The record of `config`: cached (this code's, or --keep-published's), else
        trained now. An invocation sharing the workdir may be training it already (its
        claim, `cache.claim`): then this one waits for its record, or with --train-only
        returns None and goes on, as for a run --train-only does not name."""
        while True:
            if key in self.cache or key in self._reload():
                return self.cache[key]
            if (kept := self._kept(study, method, config)) is not None:
                return {k: v for k, v in self.kept[kept].items() if k not in ("study", "method")}
            if self.train_only is not None and not any(p in method for p in self.train_only):
                return None  # another invocation's run, not trained yet
            claim = cache.claim(self.claims, key) if not self.dry_run else nullcontext(True)
            with claim as mine:
                # Saved by its trainer between the look above and the claim: not again.
                if mine and key not in self._reload():
                    record = self._train(config)
                    record["key"], record["code"] = key, self.code
                    self.cache[key] = record
                    self.save(study, method, config.seed, record)
                    return record
            if not mine:  # another invocation is training it
                if self.train_only is not None:
                    return None
                time.sleep(CLAIM_POLL_S)

    def _kept(self, study: str, method: str, config) -> str | None:
        """The key of the --keep-published run of `config` (None: none, or no such flag):
        by key, by config, else by study, method and seed."""
        if not self.kept:
            return None
        # Other invocations' runs of earlier code, saved meanwhile.
        self._keep_workdir()
        key = self.key(config)
        if key in self.kept:
            return key
        return self._same_run(config, self.kept) or self._listed(
            study, method, config.seed, self.kept
        )

    def _keep_workdir(self) -> None:
        """Adds the workdir's runs of any code to `kept`. A workdir record lacks the study
        and method the published record of the same key lists it under: it keeps them."""
        for key, record in cache.load_results(self.cache_path, code=None).items():
            self.kept[key] = self.kept.get(key, {}) | record

    def _same_run(self, config, runs: dict[str, dict]) -> str | None:
        """The key of a run of `runs` of `config` from before fields were added to the config:
        every field it has is `config`'s value, and each of `config`'s fields it lacks is
        at configs/default.py's value (a new field's default leaves runs as they were)."""
        # As JSON holds them (tuples as lists), like the records' configs.
        now = json.loads(json.dumps(config.to_dict(), default=str))
        defaults = json.loads(json.dumps(default.get_config().to_dict(), default=str))
        for key, record in runs.items():
            then = record.get("config") or {}
            if all(then[f] == v if f in then else defaults.get(f, object()) == v
                   for f, v in now.items()) and set(then) <= set(now):  # fmt: skip
                return key
        return None

    def _listed(self, study: str, method: str, seed: int, runs=None) -> str | None:
        """The key of the one run of `runs` (default: the replayed ones) listed as
        `study` / `method` / `seed`, if one."""
        runs = (self.replay if runs is None else runs) or {}
        keys = {
            k
            for k, e in runs.items()
            if (e.get("study"), e.get("method"), e.get("seed")) == (study, method, seed)
        }
        # A run two studies list (one record per key above): found under either.
        keys |= {k for k in self.listings.get((study, method, seed), ()) if k in runs}
        return keys.pop() if len(keys) == 1 else None

    def _reload(self) -> dict[str, dict]:
        """The cache with the runs other invocations saved to the workdir meanwhile."""
        if not (self.dry_run or self.replay is not None):
            for key, record in cache.load_results(self.cache_path, self.code).items():
                self.cache.setdefault(key, record)
        return self.cache

    def save(self, study: str, method: str, seed: int, record: dict) -> None:
        """Writes the new `record` to the workdir's results.json (a dry run's: nowhere)."""
        if self.dry_run:
            print(f"  {study} | {method} seed {seed}: config checked", flush=True)
            return
        cache.save_results(self.cache_path, self.cache)
        if "final_val_bits_per_byte" in record:
            result = f"val bits/byte {record['final_val_bits_per_byte']:.4f}"
        else:
            result = f"acc {record['final_test_accuracy']:.3f}"
        print(
            f"  {study} | {method} seed {seed}: {result} ({record['wall_clock_s']:.1f} s)",
            flush=True,
        )

    def _train(self, config) -> dict:
        """The record of `config` trained now (in a dry run: checked, with placeholders)."""
        started = time.time()
        if self.dry_run:
            summary, history = self._check(config)
        else:
            # A directory of this run's own: invocations may share the workdir.
            run_dir = tempfile.mkdtemp(prefix="run_", dir=self.workdir)
            summary = train_lib.train_and_evaluate(config, run_dir)
            with open(os.path.join(run_dir, "metrics.csv")) as f:
                header, *rows = [line.strip().split(",") for line in f if line.strip()]
            # An empty cell (a metric the run does not measure, e.g. local models'
            # with eval_local_examples=0) reads as NaN.
            history = [
                {k: float(v) if v else math.nan for k, v in zip(header, row, strict=True)}
                for row in rows
            ]
            shutil.rmtree(run_dir, ignore_errors=True)
        seconds = time.time() - started
        defaults = default.get_config().to_dict()
        fields = {k: v for k, v in config.to_dict().items() if defaults.get(k) != v or k == "seed"}
        final = summary["final"]
        wire = float(final.get("wire_bytes_per_step", 0.0))
        if LM_METRIC in final:  # a language model: its validation bits per byte
            quality = {
                "final_val_bits_per_byte": final[LM_METRIC],
                "final_local_bits_per_byte": final.get("val_bits_per_byte_local_mean"),
                # Every node's windows predict sequence_length next bytes each.
                "tokens_per_step": config.num_nodes * config.batch_size * config.sequence_length,
            }
            metric = LM_METRIC
        else:
            quality = {
                "final_test_accuracy": final["test_accuracy_avg_model"],
                "final_local_accuracy": final["test_accuracy_local_mean"],
            }
            metric = "test_accuracy_avg_model"
        return {
            "seed": config.seed,
            "config": json.loads(json.dumps(fields, default=str)),
            "steps": summary["steps"],
            "total_steps": summary["total_steps"],
            "epochs": history[-1]["epoch"],
            "schedule": describe_schedule(config),
            "diverged": summary["diverged"],
            **quality,
            "final_train_loss": final["train_loss"],
            "final_consensus_distance": final["consensus_distance"],
            "theta_warnings": final.get("theta_warnings", 0),
            "bytes_per_node_per_step": wire,
            "bytes_per_node_total": wire * summary["steps"],
            "bytes_by_axis": summary.get("wire_bytes_by_axis") or {},
            "collectives_per_step": summary.get("collectives_per_step") or 0.0,
            "step_time_s": final["step_time_s"],
            "wall_clock_s": seconds,
            "curve": [[row["step"], row[metric], row["train_loss"]] for row in history],
            **({"dry_run": True} if self.dry_run else {}),
        }

    def _check(self, config) -> tuple[dict, list[dict]]:
        """A dry run of `config`: the checks train_and_evaluate makes before its first step
        (`train_lib.build`: names and ranges, the model on the data, the memory), then
        the summary and metrics.csv rows a run would write, with `placeholder` numbers."""
        exp = train_lib.build(config)
        numbers = placeholder(self.key(config))
        steps = exp.total_steps
        logged = list(range(exp.loop.log_every, steps, exp.loop.log_every)) + [steps]
        history = [
            {
                "step": step,
                "epoch": step / exp.steps_per_epoch,
                "test_accuracy_avg_model": accuracy,
                "train_loss": loss,
            }
            for step, accuracy, loss in placeholder_curve(numbers, logged)
        ]
        if exp.dataset.task == "next_token":  # bits per byte: 1 to 5, falling
            for row in history:
                row[LM_METRIC] = 5.0 - 4.0 * row.pop("test_accuracy_avg_model")
        final = {
            **({LM_METRIC: history[-1][LM_METRIC]} if LM_METRIC in history[-1] else {}),
            "test_accuracy_avg_model": numbers["accuracy"],
            "test_accuracy_local_mean": numbers["accuracy"],
            "train_loss": numbers["loss"],
            "consensus_distance": numbers["consensus"],
            "theta_warnings": 0,
            "wire_bytes_per_step": numbers["bytes"],
            "step_time_s": numbers["step_time_s"],
        }
        # Split over the axes a run reports: a hierarchical one, the workers' inside each
        # machine and the machines'; any other, the nodes' (none without communication).
        layout, sent = exp.layout, numbers["bytes"]
        by_axis = {str(layout.mesh_axis): sent}
        if config.hierarchical:
            by_axis = {str(layout.local_axis): 0.9 * sent, str(layout.mesh_axis): 0.1 * sent}
        summary = {
            "final": final,
            "steps": steps,
            "total_steps": steps,
            "diverged": False,
            "wire_bytes_by_axis": by_axis,
            "collectives_per_step": numbers["collectives"],
        }
        return summary, history

    def repeat(self, study: str, method: str, base, seeds: int | None = None, **overrides):
        """The config over `seeds` seeds (default: the runner's)."""
        count = 1 if self.quick else (seeds or self.seeds)
        return [
            self.run(study, method, self.config(base, seed=seed, **overrides))
            for seed in range(count)
        ]
