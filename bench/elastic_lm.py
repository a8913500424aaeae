"""The language model trained by machines that come and go (issue 49): elastic against synchronous.

    python -m bench.elastic_lm     # configs/lm_study.py, 2,000 steps (~40 min on 2 cores)
    python -m bench.elastic_lm --steps 40 --kill_at 20 --no-write   # a quick look
    python -m bench.elastic_lm --timing 300    # the time per step alone, on quiet cores

configs/lm_study.py's recipe (lm_tiny's transformer, 2 machines x 4 workers, each
machine's model split over its workers, DiLoCo H=10 with a 4-bit min-max exchange
with error feedback, outer Nesterov 0.7 / 0.6 warmed up over 20 rounds) at one seed,
three ways on loopback:

- "synchronous": one process of 8 devices, the two machines simulated as device
  groups (`train.py --config=configs/lm_study.py`, what the study measures);
- "elastic": two processes of 4 devices, one a machine, meeting at the exchanges
  through `python -m lpdec.elastic serve` (`train.py --elastic_service=...`);
- "elastic, machine 1 killed": the same, with machine 1's command killed (kill -9
  of its process group) once its exchanges.csv shows `--kill_at` steps, and the
  same command started again (a new workdir): it joins with machine 0's state.

Each run's final validation bits per byte (the machines' model, at the end), and
its time per step: the wall time between its first and last logged step, less the
evaluations in between, over the steps between them (the exchanges included). A
run whose summary.json exists in `--workdir` is not trained again. Writes the
"bench/elastic_lm.py" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from bench import harness
from bench._sections import BENCHMARKS_HEADER
from bench._sections import replace_section
from bench._sections import versions

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "lm_study.py"
MACHINES, WORKERS = 2, 4
BITS = "val_bits_per_byte_avg_model"


def _env(devices: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _popen(command: list[str], devices: int, log: pathlib.Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the process holds it until it ends
    return subprocess.Popen(
        command, stdout=out, stderr=subprocess.STDOUT, env=_env(devices), cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip


def _train(workdir: pathlib.Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "train.py"), f"--config={CONFIG}", f"--workdir={workdir}",
        f"--config.num_steps={steps}", f"--config.log_every={max(1, steps // 20)}", *extra,
    ]  # fmt: skip


def synchronous(root: pathlib.Path, steps: int) -> pathlib.Path:
    workdir = root / "synchronous"
    if not (workdir / "summary.json").exists():
        proc = _popen(_train(workdir, steps), MACHINES * WORKERS, root / "synchronous.log")
        if proc.wait() != 0:
            raise SystemExit(f"the synchronous run failed: see {root / 'synchronous.log'}")
    return workdir


def _rounds(workdir: pathlib.Path) -> int:
    try:
        return len((workdir / "exchanges.csv").read_text().splitlines()) - 1
    except OSError:
        return 0


def elastic(root: pathlib.Path, name: str, steps: int, kill_at: int | None) -> pathlib.Path:
    """Two machines of one process each on a service of their own; with `kill_at`,
    machine 1 killed once it logged that many steps' rounds, then started again."""
    base = root / name
    if (base / "m0" / "summary.json").exists():
        return base / "m0"
    base.mkdir(parents=True, exist_ok=True)
    token = base / "token"
    token.write_text("bench-elastic-lm\n")
    port = harness.free_port()
    address = f"127.0.0.1:{port}"
    service = _popen(
        [sys.executable, "-m", "lpdec.elastic", "serve", "--bind", address,
         "--machines", str(MACHINES), "--token_file", str(token)],
        1, base / "service.log",
    )  # fmt: skip
    procs = [service]
    try:
        time.sleep(2.0)

        def machine(m: int, workdir: pathlib.Path) -> subprocess.Popen:
            command = _train(
                workdir, steps, f"--elastic_service={address}",
                f"--elastic_machines={MACHINES}", f"--elastic_machine={m}",
                f"--elastic_token_file={token}",
            )  # fmt: skip
            proc = _popen(command, WORKERS, base / f"{workdir.name}.log")
            procs.append(proc)
            return proc

        runs = [machine(m, base / f"m{m}") for m in range(MACHINES)]
        if kill_at is not None:
            h = 10  # lm_study's local steps
            while _rounds(base / "m1") < kill_at // h:
                if runs[1].poll() is not None:
                    raise SystemExit(f"machine 1 ended before step {kill_at}")
                time.sleep(0.5)
            os.killpg(runs[1].pid, signal.SIGKILL)
            runs[1].wait()
            (base / "events.txt").write_text(
                f"machine 1 killed (kill -9) after {_rounds(base / 'm1')} rounds; "
                "the same command started again in m1b\n"
            )
            runs[1] = machine(1, base / "m1b")
        for m, proc in enumerate(runs):
            if proc.wait() != 0:
                raise SystemExit(f"{name}: machine {m} failed: see {base}")
    finally:
        for proc in procs:
            harness.kill_group(proc)
    return base / "m0"


def measure(workdir: pathlib.Path) -> dict:
    """Final bits per byte and seconds per step (first to last logged step, less
    the evaluations between them)."""
    summary = json.loads((workdir / "summary.json").read_text())
    rows = list(csv.DictReader(open(workdir / "metrics.csv")))
    first, last = rows[0], rows[-1]
    evals = sum(float(r["eval_time_s"]) for r in rows[1:])
    wall = float(last["wall_time_s"]) - float(first["wall_time_s"]) - evals
    steps = int(last["step"]) - int(first["step"])
    return {
        "bits": float(summary["final"][BITS]),
        "step_s": wall / steps,
        "wire": float(last["wire_bytes_per_step"]),
        "joined": summary.get("joined_at_rounds"),
    }


def render(results: dict, steps: int, kill_at: int, note: str = "") -> str:
    sync = results["synchronous"]
    lines = [
        "## The language model, elastic (`bench/elastic_lm.py`)",
        "",
        f"configs/lm_study.py ({steps:,} steps, seed 0): 2 machines x 4 workers, each "
        "machine's model split over its workers (FSDP), DiLoCo H=10 with the 4-bit min-max "
        "exchange and error feedback, outer Nesterov 0.7 / 0.6 warmed up over 20 rounds. "
        "Synchronous: one process of 8 CPU devices (the machines simulated); elastic: one "
        "process of 4 devices per machine on loopback, meeting at a service; killed: machine "
        f"1's command killed (kill -9) at step {kill_at} and started again. Time per step: "
        "first to last logged step, evaluations left out, exchanges in. "
        f"`python -m bench.elastic_lm`; {versions()}, {os.cpu_count()} cores." + note,
        "",
        "| run | final validation bits per byte | against synchronous | time per step | "
        "against synchronous |",
        "|---|---|---|---|---|",
    ]
    for name, label in (
        ("synchronous", "synchronous (one process)"),
        ("elastic", "elastic, 2 processes"),
        ("killed", f"elastic, machine 1 killed at step {kill_at} and restarted"),
    ):
        r = results[name]
        lines.append(
            f"| {label} | {r['bits']:.4f} | {100 * (r['bits'] / sync['bits'] - 1):+.2f}% | "
            f"{r['step_s']:.3f} s | {r['step_s'] / sync['step_s']:.2f}x |"
        )
    return "\n".join(lines)


def render_timing(results: dict, steps: int) -> str:
    sync, el = results["synchronous"], results["elastic"]
    return "\n".join(
        [
            f"### Time per step on quiet cores (`python -m bench.elastic_lm --timing {steps}`)",
            "",
            f"The same two layouts for {steps} steps, one after the other, with nothing else "
            "running on the machine (first to last logged step, evaluations left out, the "
            f"exchanges in). {versions()}, {os.cpu_count()} cores.",
            "",
            "| run | time per step | against synchronous |",
            "|---|---|---|",
            f"| synchronous (one process of 8 devices) | {sync['step_s']:.3f} s | 1.00x |",
            f"| elastic (2 processes of 4 devices) | {el['step_s']:.3f} s | "
            f"{el['step_s'] / sync['step_s']:.2f}x |",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/lpdec_bench_elastic_lm")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--kill_at", type=int, default=500)
    parser.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md")
    parser.add_argument("--note", default="", help="a sentence added to the section's header")
    parser.add_argument(
        "--timing", type=int, default=0, metavar="STEPS",
        help="only the time per step: synchronous and elastic for STEPS steps (quiet cores)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < args.steps or args.kill_at % 10:
        parser.error(f"--kill_at={args.kill_at} must be a multiple of 10 in (0, --steps)")
    root = pathlib.Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    if args.timing:
        root = root / f"timing-{args.timing}"
        root.mkdir(exist_ok=True)
        timing = {
            "synchronous": measure(synchronous(root, args.timing)),
            "elastic": measure(elastic(root, "elastic", args.timing, None)),
        }
        body = render_timing(timing, args.timing)
        print(body)
        if not args.no_write:
            replace_section(
                ROOT / "BENCHMARKS.md", "bench/elastic_lm.py timing", body,
                header=BENCHMARKS_HEADER,
            )  # fmt: skip
        return
    results = {
        "synchronous": measure(synchronous(root, args.steps)),
        "elastic": measure(elastic(root, "elastic", args.steps, None)),
        "killed": measure(elastic(root, "killed", args.steps, args.kill_at)),
    }
    (root / "results.json").write_text(json.dumps(results, indent=1))
    body = render(results, args.steps, args.kill_at, f" {args.note}" if args.note else "")
    print(body)
    if not args.no_write:
        replace_section(
            ROOT / "BENCHMARKS.md", "bench/elastic_lm.py", body, header=BENCHMARKS_HEADER
        )


if __name__ == "__main__":
    main()
