"""Fault injection: break training runs on purpose and count what survives.

    python -m bench.faults                    # every fault, --repeats 3: BENCHMARKS.md
    python -m bench.faults --quick --output /tmp/faults.md   # one try of the quick faults
    python -m bench.faults --only kill9,nan   # some faults
    python -m bench.faults --elastic --repeats 3  # the elastic cases only (namespaces, root)

Each fault is tried `--repeats` times with random parameters (the step at which
a process is killed, which bytes are damaged, which node gets a NaN, ...) drawn
from `--seed`. A run-level fault drives `train.py` in subprocesses on a small
config (synthetic data, an MLP, 8 nodes, 8-bit CHOCO, 60 steps, a checkpoint
every 10) and compares the final parameters with those of an uninterrupted
run of the same config: "survived" means the run ended bit-identical to it (or,
where no run can go on, that it refused with a one-line error and exit status
2, loading nothing). A library-level fault runs an optax chain with
`lpdec.testing.run` and compares with the same chain without the fault.

The elastic cases (`--elastic`, or `--only elastic_kill,elastic_link,elastic_slow`;
not part of the default set) run 3 machines of an elastic DiLoCo run and their
coordinating service, each in its own network namespace, and kill one machine,
cut its link or slow it down; see `elastic_table` for what each try checks. They
write their own section ("Elastic faults").

The table (what was tried, how many times, what survived, what was lost) goes
into a section of `--output` (BENCHMARKS.md by default). Every subprocess is
bounded by `--timeout` and killed with its process group on the way out.

The files of this package, by fault family:

    common.py     what every family shares: Trial (one try), Context (the scratch
                  directory, the limits, the reference runs) and the helpers that run
                  train.py on the run-level faults' config (TRAIN_FLAGS)
    run_level.py  kill9, damaged, no_intact, second_run, signal, lost_process
    library.py    nan, byzantine
    elastic.py    the elastic cases: Cluster (the machines and their service),
                  the uninterrupted reference runs and the tolerance they are judged by
    __init__.py   the list of faults (FAULTS, ALIASES, QUICK), the runner, the two tables
                  and the command line (`python -m bench.faults`, __main__.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from bench import _sections
from bench import netns
from bench.faults.common import EVERY
from bench.faults.common import ROOT
from bench.faults.common import STEPS
from bench.faults.common import TRAIN_FLAGS as TRAIN_FLAGS
from bench.faults.common import Context
from bench.faults.common import Trial
from bench.faults.common import checkpoint_steps as checkpoint_steps
from bench.faults.common import final_params as final_params
from bench.faults.common import finish as finish
from bench.faults.common import identical as identical
from bench.faults.common import start as start
from bench.faults.common import start_processes as start_processes
from bench.faults.common import stderr_of as stderr_of
from bench.faults.common import summary as summary
from bench.faults.common import train as train
from bench.faults.common import wait_for_checkpoint as wait_for_checkpoint
from bench.faults.elastic import ACCURACY_POINTS
from bench.faults.elastic import ELASTIC_BOUND
from bench.faults.elastic import ELASTIC_FLAGS as ELASTIC_FLAGS
from bench.faults.elastic import ELASTIC_HEARTBEAT
from bench.faults.elastic import ELASTIC_JOIN_TIMEOUT
from bench.faults.elastic import ELASTIC_MACHINES
from bench.faults.elastic import ELASTIC_ROUNDS
from bench.faults.elastic import ELASTIC_STALL
from bench.faults.elastic import ELASTIC_STEPS
from bench.faults.elastic import ELASTIC_SUBNET as ELASTIC_SUBNET
from bench.faults.elastic import FAULT_ROUNDS
from bench.faults.elastic import LAST_EVALS
from bench.faults.elastic import LOSS_RELATIVE
from bench.faults.elastic import PACE_S
from bench.faults.elastic import PACED as PACED
from bench.faults.elastic import REFERENCE_SEEDS as REFERENCE_SEEDS
from bench.faults.elastic import SLOW_DEADLINE as SLOW_DEADLINE
from bench.faults.elastic import SLOWDOWN as SLOWDOWN
from bench.faults.elastic import Cluster as Cluster
from bench.faults.elastic import elastic_intruder
from bench.faults.elastic import elastic_kill
from bench.faults.elastic import elastic_link
from bench.faults.elastic import elastic_reference as elastic_reference
from bench.faults.elastic import elastic_slow_deadline
from bench.faults.elastic import elastic_slow_h
from bench.faults.library import byzantine
from bench.faults.library import nan_steps
from bench.faults.run_level import DAMAGES as DAMAGES
from bench.faults.run_level import damaged_checkpoint
from bench.faults.run_level import kill9
from bench.faults.run_level import lost_process
from bench.faults.run_level import no_intact_checkpoint
from bench.faults.run_level import second_run
from bench.faults.run_level import sigterm
from bench.faults.run_level import wait_past_random_checkpoint as wait_past_random_checkpoint

MARKER = "faults"


FAULTS: dict[str, tuple[str, Callable[[Context, np.random.Generator], Trial]]] = {
    "kill9": ("kill -9 of train.py at a random step", kill9),
    "damaged": ("latest checkpoint damaged (bits, bytes, truncated, deleted)", damaged_checkpoint),
    "no_intact": ("every checkpoint damaged", no_intact_checkpoint),
    "second_run": ("a second train.py in the same workdir", second_run),
    "signal": ("SIGTERM or SIGINT to train.py at a random step", sigterm),
    "lost_process": ("kill -9 of one process of a 2 x 4 run at a random step", lost_process),
    "nan": ("NaN gradients on 1-3 nodes for one step each (library)", nan_steps),
    "byzantine": ("one Byzantine node of 8, ClippedGossip (library)", byzantine),
    "elastic_kill": ("kill -9 of one elastic machine, restarted 5-15 s later", elastic_kill),
    "elastic_link": ("one elastic machine's link down for 10 s", elastic_link),
    "elastic_slow_deadline": (
        "one elastic machine 10x slower, same H, deadline 0.1 s",
        elastic_slow_deadline,
    ),
    "elastic_slow_h": ("one elastic machine 10x slower with H / 10", elastic_slow_h),
    "elastic_intruder": (
        "a wrong token and a missing certificate claim a live elastic slot (mutual TLS)",
        elastic_intruder,
    ),
}
ALIASES = {
    "elastic_slow": ("elastic_slow_deadline", "elastic_slow_h"),
    "elastic": (
        "elastic_kill",
        "elastic_link",
        "elastic_slow_deadline",
        "elastic_slow_h",
        "elastic_intruder",
    ),
}
ELASTIC = ALIASES["elastic"]
ELASTIC_MARKER = "faults elastic"
QUICK = ("damaged", "nan", "byzantine")  # the second run: tests/test_reliability.py


def run(
    names, repeats: int, seed: int, timeout: float, info: dict | None = None, keep: str = ""
) -> list[dict]:
    """Tries each fault `repeats` times; one row per fault. `info` gets the elastic
    reference run and whether namespaces were used; `keep`: a directory to leave the
    runs' workdirs and logs in (else a temporary one, removed)."""
    rng = np.random.default_rng(seed)
    rows = []
    if keep:
        pathlib.Path(keep).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lpdec-faults-", dir=keep or None) as tmp:
        if keep:
            tmp = tempfile.mkdtemp(prefix="lpdec-faults-", dir=keep)
        ctx = Context(pathlib.Path(tmp), timeout)
        if any(name in ELASTIC for name in names):
            ctx.no_namespaces = netns.unavailable()
            if ctx.no_namespaces:
                print(f"elastic faults on loopback: {ctx.no_namespaces}", flush=True)
        for name in names:
            what, fn = FAULTS[name]
            trials, started = [], time.monotonic()
            # A fault that came too late to hit the run is tried again (at most `repeats` times).
            attempts = 0
            while sum(t.happened for t in trials) < repeats and attempts < 2 * repeats:
                attempts += 1
                try:
                    trials.append(fn(ctx, rng))
                except Exception as error:  # a crash of the harness is a lost trial
                    trials.append(Trial(False, f"{type(error).__name__}: {error}"))
                trials[-1].note = trials[-1].note.replace(str(ctx.root), "$TMP")
                print(f"{name}: {trials[-1]}", flush=True)
                if trials[-1].skipped:
                    break
            skipped = [t for t in trials if t.skipped]
            missed = [t for t in trials if not t.happened and not t.skipped]
            trials = [t for t in trials if t.happened and not t.skipped]
            rows.append(
                {
                    "fault": name,
                    "what": what,
                    "tried": len(trials),
                    "survived": sum(t.survived for t in trials),
                    "missed": len(missed),
                    "skipped": skipped[0].note if skipped else None,
                    "notes": [t.note for t in trials],
                    "lost": [t.note for t in trials if not t.survived],
                    "trials": [{"survived": t.survived, **t.data} for t in trials],
                    "seconds": time.monotonic() - started,
                }
            )
        if info is not None:
            info["namespaces"] = ctx.namespaces
            info["no_namespaces"] = ctx.no_namespaces
            info["elastic_reference"] = ctx._elastic
    return rows


def table(rows: list[dict], command: str) -> str:
    lines = [
        "## Fault injection (`bench/faults.py`)",
        "",
        f"`{command}` — {_sections.versions()}. Run-level faults drive `train.py`",
        f"(synthetic data, MLP, 8 nodes, 8-bit CHOCO, {STEPS} steps, a checkpoint every "
        f"{EVERY}); survived = the run ended bit-identical to an uninterrupted one, or refused "
        "with one `error:` line and exit status 2 where it cannot go on.",
        "",
        "| fault | tried | survived | lost | what happened (each try) |",
        "|---|---|---|---|---|",
    ]

    def short(note: str) -> str:
        note = note.replace("|", "/")
        return note if len(note) <= 160 else note[:157] + "..."

    for row in rows:
        lost = "nothing" if not row["lost"] else "; ".join(short(n) for n in row["lost"])
        notes = "; ".join(short(n) for n in row["notes"])
        if row["missed"]:
            notes += f" ({row['missed']} more came after the run had ended: tried again)"
        lines.append(f"| {row['what']} | {row['tried']} | {row['survived']} | {lost} | {notes} |")
    return "\n".join(lines)


def elastic_table(rows: list[dict], command: str, info: dict) -> str:
    """The elastic cases' section: one line per try, with what each check measured."""
    ref = info.get("elastic_reference") or {}
    where = (
        "each machine and the coordinating service in its own network namespace on one "
        "bridge (`bench/netns.py`)"
        if info.get("namespaces")
        else f"all on loopback ({info.get('no_namespaces')}; the link-down case is not run)"
    )
    lines = [
        "## Elastic faults (`bench/faults.py`)",
        "",
        f"`{command}` — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{_sections.versions()}, {os.cpu_count()} CPU cores shared with other work.",
        "",
        f"3 machines of an elastic DiLoCo run (`train.py --elastic_service`, "
        f"`configs/elastic_mlp.py` with `--config.num_steps={ELASTIC_STEPS}`: "
        f"H = 10 local steps per round, 4-bit error-feedback mean; its "
        '`elastic_budget = "samples"` ends the run at the first exchange after which the '
        "rounds' members' local steps add up to "
        f"{ELASTIC_MACHINES} x {ELASTIC_STEPS}, the uninterrupted run's {ELASTIC_ROUNDS} "
        f"rounds, so a faulted run takes more rounds), {where}; "
        f"heartbeat timeout {ELASTIC_HEARTBEAT} s, join timeout {ELASTIC_JOIN_TIMEOUT} s, "
        "exchange deadline 60 s unless said; each machine is `train.py` under its supervisor "
        "(`--elastic_restarts`, default 5: a machine process that ends abnormally is started "
        "again and joins). In the kill and link-down cases every machine paces its rounds at "
        f"≥ {PACE_S:g} s (`LPDEC_ELASTIC_PACE`; a round takes about 0.1 s unpaced), so "
        "that the two others do not race through the run while the third restarts; the fault "
        f"comes after a round drawn from {FAULT_ROUNDS[0]}..{FAULT_ROUNDS[1] - 1}; the kill "
        "is a SIGKILL of the machine's process group (supervisor and child), and the same "
        "command is started again 5-15 s later. Every process of a try must end within "
        f"{ELASTIC_BOUND:g} s. The uninterrupted runs of the same length (once per "
        "invocation, one per seed; the tries run seed 0): "
        + ", ".join(
            f"seed {r['seed']}: test accuracy {100 * r['accuracy']:.2f} %, test loss "
            f"{r['loss']:.4f} (means of the last {LAST_EVALS} evaluations), "
            f"{r.get('rounds', '?')} rounds in {r.get('took_s', float('nan')):.0f} s"
            for r in ref.get("runs", [])
        )
        + f" (commit {ref.get('commit', '?')}).",
        "",
        "A try survives when every check holds: all processes ended with status 0 within "
        f"the bound; no exchange of the machines not faulted waited more than "
        f"{ELASTIC_STALL:g} s; every exchange's members started from the same anchor and "
        "the three final anchors are equal; the anchor's test accuracy, mean of its last "
        f"{LAST_EVALS} evaluations (the last {LAST_EVALS * 50} steps), at least the worst "
        f"uninterrupted run's less {ACCURACY_POINTS:g} point and its test loss (the same "
        f"mean) at most the worst uninterrupted run's plus {100 * LOSS_RELATIVE:g} % "
        "(one-sided: a faulted run may end better; fixed before measuring); and per case: "
        "kill / "
        "link — the machine joined again, its first exchange after joining included it and "
        "agreed, the others had rounds with fewer members; slow, same H — the others' means "
        "went on without it; slow, H / 10 — every round had all 3; intruder — the cluster "
        "runs with the run's credentials (mutual TLS between the service and the machines, "
        "jax >= 0.11.2) instead of a private network, and at the fault's round two processes "
        "start as a live machine's slot under train.py's supervisor, one with the run's "
        "certificates but a wrong token, one with the right token but no certificates: "
        "each must end with one error line, and the run must have no short round and no "
        "restarted machine.",
        "",
        "| case | try | commit | survived | exits | s | rounds | short rounds | "
        "longest wait (s) | "
        "joined at round | first exchange after join | anchors | test acc (Δ points) | "
        "test loss (Δ) | failed checks; what happened |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(text) -> str:
        text = str(text).replace("|", "/")
        return text if len(text) <= 300 else text[:297] + "..."

    for row in rows:
        if row["skipped"]:
            lines.append(
                f"| {row['what']} | — | not run | | | | | | | | | | | {cell(row['skipped'])} |"
            )
            continue
        for k, (trial, note) in enumerate(zip(row["trials"], row["notes"], strict=True)):
            if "exits" not in trial:  # the harness itself failed
                lines.append(
                    f"| {row['what']} | {k + 1} | | no | | | | | | | | | | | {cell(note)} |"
                )
                continue
            failed = ", ".join(trial["failed"]) or "none"
            extra = ""
            if "slow_included" in trial:
                extra = (
                    f" (slow machine's own contribution in its means: {trial['slow_included']}; "
                    f"in machine {(trial['machine'] + 1) % ELASTIC_MACHINES}'s: "
                    f"{trial['slow_in_means']})"
                )
            joined = cell(trial.get("joined_at", "—"))
            if "restarts" in trial:
                joined += f" ({trial['restarts']} supervisor restarts)"
            anchors = "equal" if trial["anchors_agree"] else f"{trial['digests']} distinct"
            if trial.get("no_summary"):
                anchors += f", none from {trial['no_summary']}"
            lines.append(
                f"| {row['what']} | {k + 1} | {trial.get('commit', '?')} | "
                f"{'yes' if trial['survived'] else 'no'} | "
                f"{' '.join(str(c) for c in trial['exits'])} | {trial['took_s']:.0f} | "
                f"{trial.get('rounds', '?')} | "
                f"{trial['short_rounds']} | {trial['longest_wait_s']:.2f} | "
                f"{joined} | "
                f"{cell(trial.get('first_after_join') or '—')} | "
                f"{anchors} | {100 * trial['accuracy']:.2f} ({trial['d_accuracy_points']:+.2f}) | "
                f"{trial['loss']:.4g} ({100 * trial['d_loss_relative']:+.3g} %) | "
                f"{cell(failed + '; ' + note + extra)} |"
            )
    lines += [
        "",
        "Columns: *commit* — the checkout the try's processes were started from; "
        "*exits* — the exit status of each machine's last process (0 ok, 2 refused, "
        "4 lost the service; a machine killed at the bound shows -9); *s* — seconds from the "
        "start of the service to the end of the last machine; *rounds* — the exchanges of "
        "the run (a machine not faulted: `summary.json`'s rounds); *short rounds* — exchanges, "
        "summed over the machines not faulted, whose mean had fewer than 3 members; *longest "
        "wait* — the longest `waited_s` of those machines' exchanges (time from contributing "
        "to the round's decision); *joined at round* — the faulted machine's "
        "`joined_at_rounds`; *first exchange after join* — its first `exchanges.csv` row from "
        "that round on (members, `anchors_agree`); *anchors* — whether every exchange's "
        "contributions started from one anchor and the three `final_anchor_digest`s are "
        "equal (else how many distinct final anchors); *test acc* — the anchor's "
        "`test_accuracy_avg_model`, mean of its last evaluations, mean of the 3 machines "
        "(equal when the "
        "anchors are), and its difference from the worst uninterrupted run's; *test loss* "
        "— `test_loss_avg_model` of the anchor (mean cross-entropy on the test set), the "
        "same mean, and its relative difference from the worst uninterrupted run's.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", default="", help="comma-separated faults: " + ",".join([*FAULTS, *ALIASES])
    )
    parser.add_argument("--quick", action="store_true", help="one try of " + ",".join(QUICK))
    parser.add_argument("--elastic", action="store_true", help="the elastic cases: --only elastic")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--keep", default="", help="leave the runs' workdirs and logs here")
    args = parser.parse_args(argv)
    default = list(QUICK) if args.quick else [n for n in FAULTS if n not in ELASTIC]
    names = [n for n in args.only.split(",") if n] or (list(ELASTIC) if args.elastic else default)
    names = list(dict.fromkeys(x for n in names for x in ALIASES.get(n, (n,))))
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join([*FAULTS, *ALIASES])}")
    repeats = 1 if args.quick else args.repeats
    if any(name in ELASTIC for name in names):
        netns.install_cleanup()  # Ctrl-C or SIGTERM: kill the machines, remove the namespaces
    info: dict = {}
    rows = run(names, repeats, args.seed, args.timeout, info, args.keep)
    command = "python -m bench.faults " + " ".join(argv if argv is not None else sys.argv[1:])
    plain = [r for r in rows if r["fault"] not in ELASTIC]
    elastic_rows = [r for r in rows if r["fault"] in ELASTIC]
    if plain:
        _sections.replace_section(
            args.output, MARKER, table(plain, command.strip()), header=_sections.BENCHMARKS_HEADER
        )
    if elastic_rows:
        _sections.replace_section(
            args.output,
            ELASTIC_MARKER,
            elastic_table(elastic_rows, command.strip(), info),
            header=_sections.BENCHMARKS_HEADER,
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    lost = sum(r["tried"] - r["survived"] for r in rows)
    print(f"{sum(r['tried'] for r in rows)} tries, {lost} lost")
    return 1 if lost else 0
