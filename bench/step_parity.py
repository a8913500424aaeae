"""The step across processes, like for like: lpdec's all-reduce against PyTorch DDP (issue 51).

    python -m bench.step_parity            # ~10 min on 2 idle cores; writes BENCHMARKS.md

configs/lm_study.py's transformer (lm_tiny's: 120,576 parameters, 64-byte windows),
Adam, float32, 4,096 tokens a step in all, on loopback. Every process is pinned to
one core of its own (`taskset -c`) and runs one thread: XLA with
`--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`, PyTorch with
`torch.set_num_threads(1)`; so neither oversubscribes the 2 cores. Layout (a), DDP's:
one process per machine holding the whole model, 2 machines of 2,048 tokens each.

The rows, each one run (`train.py` for lpdec, `bench/ddp_lm.py` for DDP), the
median seconds per step after the first logged interval (compilation out):

- lpdec, one process (the compute of 4,096 tokens, no collective);
- lpdec, 2 processes, no exchange (`algorithm="none"`): each process's compute and
  dispatch of 2,048 tokens, no collective;
- lpdec, 2 processes, the fp32 all-reduce of the gradients (`algorithm="allreduce"`);
- DDP, 2 processes (gloo, buckets overlapped with the backward pass).

The all-reduce's share is the third row less the second: the collective and the
synchronisation it brings. `--before DIR:ROW:LABEL` adds a row of another run of
this script (an older commit's checkout, run just before) to the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import statistics
import subprocess
import sys

from bench import harness
from bench._sections import BENCHMARKS_HEADER
from bench._sections import replace_section
from bench._sections import versions

ROOT = pathlib.Path(__file__).resolve().parent.parent
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
TOKENS = 4096
WINDOW = 64


def _env(devices: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {ONE_THREAD}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _lpdec(
    workdir: pathlib.Path, processes: int, algorithm: str, steps: int, workers: int = 1
) -> list[list[str]]:
    """Layout (a) (`workers=1`): each process one device holding the whole model; layout
    (b): each process a machine of `workers` devices, its model split over them (FSDP)."""
    port = harness.free_port()
    nodes = processes * workers
    windows = TOKENS // WINDOW // nodes
    sharded = "True" if workers > 1 else "False"
    commands = []
    for p in range(processes):
        command = [
            "taskset", "-c", str(p % (os.cpu_count() or 1)), sys.executable,
            str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'lm_study.py'}",
            f"--workdir={workdir}", f"--config.num_nodes={nodes}",
            f"--config.hierarchical={sharded}", "--config.machines=0",
            f"--config.shard_model={sharded}", f"--config.algorithm={algorithm}",
            "--config.local_steps=1", "--config.error_feedback=False",
            "--config.outer_warmup_rounds=0", f"--config.batch_size={windows}",
            f"--config.num_steps={steps}", f"--config.log_every={steps // 5}",
            f"--config.warmup_steps={steps // 20}", "--config.validation_windows=64",
        ]  # fmt: skip
        if processes > 1:
            command += [
                f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
                f"--process_id={p}",
            ]  # fmt: skip
        commands.append(command)
    return commands


def _run(
    commands: list[list[str]], log: pathlib.Path, timeout: float = 1200, devices: int = 1
) -> None:
    procs = [
        subprocess.Popen(
            c,
            stdout=open(f"{log}.{i}", "w"),
            stderr=subprocess.STDOUT,  # noqa: SIM115
            env=_env(devices),
            cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        for i, c in enumerate(commands)
    ]
    try:
        for proc in procs:
            if proc.wait(timeout=timeout) != 0:
                raise SystemExit(f"a run failed: see {log}.*")
    finally:
        for proc in procs:
            harness.kill_group(proc)


def lpdec_step(
    root: pathlib.Path, name: str, processes: int, algorithm: str, steps: int, workers: int = 1
) -> float:
    workdir = root / name
    if not (workdir / "metrics.csv").exists():
        commands = _lpdec(workdir, processes, algorithm, steps, workers)
        _run(commands, root / f"{name}.log", devices=workers)
    rows = list(csv.DictReader(open(workdir / "metrics.csv")))
    # The first interval holds the compilation; the others are steady.
    return statistics.median(float(r["step_time_s"]) for r in rows[1:])


def ddp_step(root: pathlib.Path, steps: int, per_machine: int = 1) -> float:
    """DDP over 2 machines of `per_machine` processes each (one per worker in layout
    (b)), each process on its machine's core with one thread."""
    world = 2 * per_machine
    name = "ddp" if per_machine == 1 else f"ddp_{world}"
    out = root / f"{name}_rank0.json"
    if not out.exists():
        port = harness.free_port()
        commands = [
            ["taskset", "-c", str(rank // per_machine), sys.executable,
             str(ROOT / "bench" / "ddp_lm.py"),
             "--rank", str(rank), "--world", str(world), "--master", f"127.0.0.1:{port}",
             "--threads", "1", "--batch-per-thread", str(TOKENS // WINDOW // world),
             "--d-model", "64", "--layers", "2", "--heads", "4", "--lr", "8e-3",
             "--steps", str(steps), "--warmup", "5",
             "--out", str(root / f"{name}_rank{rank}.json")]
            for rank in range(world)
        ]  # fmt: skip
        _run(commands, root / f"{name}.log")
    result = json.loads(out.read_text())
    assert result["parameters"] == 120_576, result  # lm_tiny's transformer
    return float(result["s_per_step"])


ROW_NAMES = {
    "allreduce_2": "layout (a): lpdec, 2 processes, fp32 all-reduce",
    "allreduce_2x4": "layout (b): lpdec, 2 processes of 4 devices, FSDP, fp32 all-reduce",
}


def render(rows: dict, steps: int, before: list | None = None) -> str:
    ddp = rows["ddp"]
    allreduce, none = rows["allreduce_2"], rows["none_2"]
    lines = [
        "## The step across processes, like for like (`bench/step_parity.py`)",
        "",
        "configs/lm_study.py's transformer (120,576 parameters), Adam, float32, 4,096 "
        "tokens a step in all; layout (a): one process per machine holding the whole "
        "model, 2 machines of 2,048 tokens; every process pinned to its own core "
        "(`taskset -c`) with one thread (XLA's eigen pool off, "
        "`intra_op_parallelism_threads=1`; `torch.set_num_threads(1)`), on loopback. "
        f"Median seconds per step over {steps} steps after the first interval. "
        f"`python -m bench.step_parity`; {versions()}, {os.cpu_count()} cores.",
        "",
        "| run | seconds per step | against DDP |",
        "|---|---|---|",
        f"| lpdec, one process, 4,096 tokens | {rows['one']:.4f} | {rows['one'] / ddp:.2f}x |",
        f"| lpdec, 2 processes, no exchange (compute and dispatch of 2,048 tokens) | "
        f"{none:.4f} | {none / ddp:.2f}x |",
        f"| lpdec, 2 processes, fp32 all-reduce of the gradients | {allreduce:.4f} | "
        f"{allreduce / ddp:.2f}x |",
        f"| PyTorch DDP, 2 processes (gloo, buckets) | {ddp:.4f} | 1.00x |",
    ]
    for where, key, label in before or []:
        old, what = where[key], ROW_NAMES[key]
        reference = where["ddp"] if key == "allreduce_2" else where.get("ddp_8", rows["ddp_8"])
        lines.append(f"| {what}, before ({label}) | {old:.4f} | {old / reference:.2f}x |")
    lines += [
        f"| layout (b), 2 machines x 4 workers: lpdec, 2 processes of 4 devices, the model "
        f"split over them (FSDP), fp32 all-reduce between the machines | "
        f"{rows['allreduce_2x4']:.4f} | {rows['allreduce_2x4'] / rows['ddp_8']:.2f}x (of "
        "the next row) |",
        f"| layout (b): PyTorch DDP, 8 processes (one per worker, 4 on each core) | "
        f"{rows['ddp_8']:.4f} | 1.00x |",
        "",
        f"The all-reduce's share of lpdec's 2-process step: {allreduce - none:.4f} s "
        f"({100 * (allreduce - none) / allreduce:.0f}%); the rest is each process's "
        "compute, host dispatch and per-step Python.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/lpdec_bench_step_parity")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--before", action="append", default=[], metavar="DIR:ROW:LABEL",
        help="a row (allreduce_2 or allreduce_2x4) of another run's --workdir (an older "
        "commit's checkout, run just before) and its label; may be repeated",
    )  # fmt: skip
    args = parser.parse_args(argv)
    root = pathlib.Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    rows = {
        "one": lpdec_step(root, "one", 1, "none", args.steps),
        "none_2": lpdec_step(root, "none_2", 2, "none", args.steps),
        "allreduce_2": lpdec_step(root, "allreduce_2", 2, "allreduce", args.steps),
        "ddp": ddp_step(root, args.steps),
        # Layout (b): 2 machines x 4 workers: lpdec's FSDP inside a machine against DDP
        # with one process per worker.
        "allreduce_2x4": lpdec_step(root, "allreduce_2x4", 2, "allreduce", args.steps, 4),
        "ddp_8": ddp_step(root, args.steps, per_machine=4),
    }
    (root / "results.json").write_text(json.dumps(rows, indent=1))
    before = []
    for spec in args.before:
        where, key, label = spec.split(":", 2)
        before.append((json.loads((pathlib.Path(where) / "results.json").read_text()), key, label))
    body = render(rows, args.steps, before)
    print(body)
    if not args.no_write:
        replace_section(
            ROOT / "BENCHMARKS.md", "bench/step_parity.py", body, header=BENCHMARKS_HEADER
        )


if __name__ == "__main__":
    main()
