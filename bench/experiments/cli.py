"""The command line: `python -m bench.experiments STUDY... [--quick] [--render] [--dry-run]`."""

from __future__ import annotations

import argparse
import os
import time

import jax

from bench import _sections
from bench.experiments import ad_psgd
from bench.experiments import cache
from bench.experiments import centralized
from bench.experiments import gamma
from bench.experiments import lm
from bench.experiments import moniqua
from bench.experiments import mx
from bench.experiments import precision
from bench.experiments import qgm
from bench.experiments import render
from bench.experiments import scale
from bench.experiments import table2
from bench.experiments import theorem1
from bench.experiments import tradeoff
from bench.experiments.runner import Runner

DESCRIPTION = (
    "Reproduce the seeds' claims at training length; "
    "writes EXPERIMENTS.md, docs/experiments.json, docs/*.png."
)
# Where --dry-run writes by default: never over EXPERIMENTS.md and docs/.
DRY_RUN_OUTPUT = os.path.join(cache.ROOT, "runs", "experiments_dry_run", "EXPERIMENTS.md")
# Each study takes the runner and the plot directory and returns its section's markdown.
STUDY_FUNCTIONS = {
    "gamma": gamma.gamma,
    "table2": table2.table2,
    "precision": precision.precision,
    "qgm": qgm.qgm,
    "moniqua": moniqua.moniqua,
    "theorem1": theorem1.theorem1,
    "centralized": centralized.centralized,
    "tradeoff": tradeoff.tradeoff,
    "mx": mx.mx,
    "ad_psgd": ad_psgd.ad_psgd,
    "lm": lm.lm,
    "scale": scale.scale,
}


def main(argv=None) -> None:
    """Runs (or with --render, renders) the studies named in `argv`; see bench.experiments."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments", description=DESCRIPTION)
    parser.add_argument("studies", nargs="+", choices=cache.STUDIES + ("all",))
    parser.add_argument("--quick", action="store_true", help="few steps, one seed (smoke test)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--output",
        default=None,
        help="default: EXPERIMENTS.md; with --dry-run, "
        + os.path.relpath(DRY_RUN_OUTPUT, cache.ROOT),
    )
    parser.add_argument(
        "--docs", default=None, help="plot and experiments.json directory (default: docs/)"
    )
    parser.add_argument("--workdir", default=os.path.join(cache.ROOT, "runs", "experiments"))
    parser.add_argument(
        "--render", action="store_true", help="tables and plots from experiments.json only"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="train nothing: check every run's config as train.py does before its first "
        "step and fill the tables with placeholder numbers (a study's whole grid in "
        "seconds); never cached, never written over trained runs",
    )
    parser.add_argument(
        "--train-only",
        default=None,
        help="parts of method labels, separated by '|' (labels hold commas): train only "
        "those methods' runs "
        "(others come from the workdir's cache or wait), write no report; lets several "
        "invocations share one study's runs (a run one of them is training is claimed: "
        "the others skip it, or without --train-only wait for its record)",
    )
    parser.add_argument(
        "--keep-published",
        action="store_true",
        help="count every run docs/experiments.json holds as cached, whatever code "
        "trained it (found by config key, else by study, method and seed); the report "
        "names each record's code fingerprint. Lets a long study grow across code changes",
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="train nothing: write the report from the runs already in the workdir's "
        "cache (a study still running elsewhere shows what it has so far)",
    )
    args = parser.parse_args(argv)
    output = args.output or (
        DRY_RUN_OUTPUT if args.dry_run else os.path.join(cache.ROOT, "EXPERIMENTS.md")
    )

    jax.config.update("jax_compilation_cache_dir", os.path.join(cache.ROOT, "runs", "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    docs = args.docs or os.path.join(os.path.dirname(os.path.abspath(output)), "docs")
    os.makedirs(docs, exist_ok=True)
    json_path = os.path.join(docs, "experiments.json")
    replay, dry_run = None, args.dry_run
    if args.render:
        if not os.path.exists(json_path):
            raise SystemExit(f"error: --render needs {json_path}; run the studies first.")
        replay = cache.load_published(json_path)
        # What the file holds decides: a dry run's placeholders render as a dry run.
        dry_run = any(r.get("dry_run") for r in replay.values())
    elif dry_run:
        cache.refuse_trained(json_path)
    workdir = args.workdir + ("_quick" if args.quick else "")
    runner = Runner(
        args.quick,
        args.seeds,
        workdir,
        replay=replay,
        published=None if args.quick else json_path,
        dry_run=dry_run,
        keep_published=args.keep_published,
    )
    if args.train_only:
        # "|" between parts: method labels hold ", " themselves.
        runner.train_only = tuple(part for part in args.train_only.split("|") if part.strip())
    report = not args.train_only
    if args.cached_only:
        runner.train_only = ()
    studies = cache.STUDIES if "all" in args.studies else tuple(args.studies)
    for name in studies:
        started = time.time()
        runner.study_keys, runner.trained_seconds = set(), 0.0
        print(f"study {name}", flush=True)
        body = STUDY_FUNCTIONS[name](runner, docs)
        if not report:
            print(f"study {name}: trained what --train-only names; no report", flush=True)
            continue
        minutes = (time.time() - started) / 60
        command = f"python -m bench.experiments {name}" + (" --quick" if args.quick else "")
        command += " --dry-run" if dry_run else ""
        body = render.with_command(body, command, render.timing(runner, minutes, args.render))
        if not args.render:
            cache.publish(json_path, runner.code, runner.entries, (name,), dry_run=dry_run)
        _sections.replace_section(output, f"study:{name}", body, header=render.HEADER)
        print(f"study {name} done in {minutes:.1f} min", flush=True)
    if os.path.exists(json_path):
        _sections.replace_section(
            output, "runtime", render.runtime(json_path), header=render.HEADER
        )
