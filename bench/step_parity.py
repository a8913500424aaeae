"""The step across processes, like for like: lpdec's all-reduce against PyTorch DDP (issue 51).

    python -m bench.step_parity            # ~15 min on 2 idle cores; writes BENCHMARKS.md
    python -m bench.step_parity --workloads lm --steps 100 --no-write   # a shorter look

Two workloads, each the same model, batch, optimizer, learning rate and float32 on
both sides:

- lm: configs/lm_study.py's transformer (120,576 parameters, 64-byte windows), Adam
  8e-3 with its warm-up and cosine, 4,096 tokens a step in all (`bench/ddp_lm.py`);
- mlp: configs/link_mlp.py's MLP without its norm layers (`norm="none"`, 1,101,834
  parameters) on MNIST-1D, Nesterov SGD 0.1 with weight decay 1e-4, 256 sequences a
  step in all (`bench/ddp_mlp.py`).

Both sides train on the same data (train.py's training set, written to an .npy /
.npz for PyTorch); each side draws its own batches and initial weights, so their
loss curves agree in trend, not bit for bit.

Two layouts of 2 machines, on loopback: (a) DDP's, one process per machine holding
the whole model; (b) lpdec's, a process per machine with 4 devices (the workers:
the lm split over them with FSDP, the MLP replicated with a full-precision mean
inside the machine) against DDP with one process per worker (8). Every process is
pinned to its machine's core (`taskset -c`) and runs one thread: XLA with
`--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`, PyTorch with
`torch.set_num_threads(1)`; so neither oversubscribes the 2 cores.

The rows (`train.py` for lpdec), seconds per step (the median after the first
logged interval, which holds compilation), tokens or sequences per second, and the
training loss at each logged step:

- lpdec, one process (the compute of the whole step, no collective);
- lpdec, 2 processes, no exchange (`algorithm="none"`): each process's compute and
  dispatch of its half, no collective;
- lpdec, 2 processes, the fp32 all-reduce of the gradients, layouts (a) and (b);
- DDP, layouts (a) and (b) (gloo, buckets overlapped with the backward pass).

The all-reduce's share is the all-reduce row less the no-exchange row.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

from bench import harness
from bench._sections import BENCHMARKS_HEADER
from bench._sections import replace_section
from bench._sections import versions

ROOT = pathlib.Path(__file__).resolve().parent.parent
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
MACHINES = 2
WORKERS = 4


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model both sides train: its config, its batch in all, and DDP's script."""

    name: str
    config: str
    title: str
    unit: str  # what a step's batch counts: tokens or sequences
    batch: int  # rows (windows or sequences) a step, in all
    per_row: int  # units a row
    overrides: tuple[str, ...]
    parameters: int

    def rows_per(self, nodes: int) -> int:
        return self.batch // nodes


LM = Workload(
    name="lm",
    config="lm_study.py",
    title="configs/lm_study.py's transformer (120,576 parameters), Adam 8e-3 with its "
    "warm-up and cosine",
    unit="tokens",
    batch=64,
    per_row=64,
    overrides=(
        "--config.local_steps=1",
        "--config.error_feedback=False",
        "--config.outer_warmup_rounds=0",
        "--config.validation_windows=64",
    ),  # fmt: skip
    parameters=120_576,
)
MLP = Workload(
    name="mlp",
    config="link_mlp.py",
    title="configs/link_mlp.py's MLP without its norm layers (1,101,834 parameters), "
    "Nesterov SGD 0.1, weight decay 1e-4",
    unit="sequences",
    batch=256,
    per_row=1,
    overrides=("--config.norm=none", "--config.topology=complete"),
    parameters=1_101_834,
)
WORKLOADS = {"lm": LM, "mlp": MLP}


def _env(devices: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {ONE_THREAD}"
    env["OMP_NUM_THREADS"] = "1"
    return env


#: --no-pin: every process free to run on any core (still one compute thread each).
PIN = True


def _pin(process: int) -> list[str]:
    if not PIN:
        return []
    return ["taskset", "-c", str(process % (os.cpu_count() or 1))]


def _lpdec(
    w: Workload,
    workdir: pathlib.Path,
    processes: int,
    algorithm: str,
    steps: int,
    workers: int,
    extra: tuple[str, ...] = (),
) -> list[list[str]]:
    """Layout (a) (`workers=1`): each process one device holding the whole model; layout
    (b): each process a machine of `workers` devices (the lm split over them, FSDP)."""
    port = harness.free_port()
    nodes = processes * workers
    machines = workers > 1
    sharded = machines and w is LM
    # A machine alone (one process of `workers` devices): its half of the step, as
    # config.machines=1, whose all-reduce between the machines has no one to reach
    # (train.py takes machines only with an exchange).
    alone = processes == 1 and machines
    algorithm = "allreduce" if alone else algorithm
    batch = w.rows_per(MACHINES * workers if alone else nodes)
    commands = []
    for p in range(processes):
        command = [
            *_pin(p), sys.executable, str(ROOT / "train.py"),
            f"--config={ROOT / 'configs' / w.config}", f"--workdir={workdir}",
            f"--config.num_nodes={nodes}", f"--config.hierarchical={machines}",
            f"--config.machines={int(alone)}", f"--config.shard_model={sharded}",
            f"--config.algorithm={algorithm}", f"--config.batch_size={batch}",
            f"--config.num_steps={steps}", f"--config.log_every={steps // 10}",
            "--config.checkpoint_every=0", *w.overrides, *extra,
        ]  # fmt: skip
        if w is LM:
            command.append(f"--config.warmup_steps={steps // 20}")
        if processes > 1:
            command += [
                f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
                f"--process_id={p}",
            ]  # fmt: skip
        commands.append(command)
    return commands


def _run(commands: list[list[str]], log: pathlib.Path, devices: int = 1) -> None:
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
    ended = harness.wait_all(procs, timeout=1200)  # kills what still runs
    if not ended or any(proc.returncode != 0 for proc in procs):
        raise SystemExit(f"a run failed or timed out: see {log}.*")


@dataclasses.dataclass
class Row:
    seconds: float  # per step, median
    losses: list  # [step, mean training loss over the interval]


def lpdec_row(
    w: Workload,
    root: pathlib.Path,
    processes: int,
    algorithm: str,
    steps: int,
    workers: int = 1,
    process_sum: str = "jax",
) -> Row:
    name = f"{w.name}_{algorithm}_{processes}x{workers}"
    # Always named: train.py's default ("auto") takes the host sum where it fits.
    extra = (f"--config.process_sum={process_sum}",)
    if process_sum != "jax":
        name = f"{name}_{process_sum}"
    workdir = root / name
    if not (workdir / "metrics.csv").exists():
        commands = _lpdec(w, workdir, processes, algorithm, steps, workers, extra)
        _run(commands, root / f"{name}.log", devices=workers)
    rows = list(csv.DictReader(open(workdir / "metrics.csv")))
    # The first interval holds the compilation; the others are steady.
    seconds = statistics.median(float(r["step_time_s"]) for r in rows[1:])
    return Row(seconds, [[int(r["step"]), float(r["train_loss"])] for r in rows])


def training_data(w: Workload, root: pathlib.Path) -> pathlib.Path:
    """train.py's training set of `w`, for PyTorch: the lm's windows (.npy), MNIST-1D (.npz)."""
    path = root / (f"{w.name}_train.npy" if w is LM else f"{w.name}_train.npz")
    if path.exists():
        return path
    sys.path.insert(0, str(ROOT))
    from train_lib import setup  # noqa: PLC0415 (jax only where the data is made)

    module = {"lm_study.py": "configs.lm_study", "link_mlp.py": "configs.link_mlp"}[w.config]
    config = __import__(module, fromlist=["get_config"]).get_config()
    dataset = setup.load_dataset(config)
    if w is LM:
        np.save(path, np.asarray(dataset.x_train, np.uint8))
    else:
        np.savez(path, x_train=dataset.x_train, y_train=dataset.y_train)
    return path


def ddp_row(w: Workload, root: pathlib.Path, steps: int, per_machine: int = 1) -> Row:
    """DDP over 2 machines of `per_machine` processes each (one per worker in layout
    (b)), each process on its machine's core with one thread."""
    world = MACHINES * per_machine
    name = f"{w.name}_ddp_{world}"
    out = root / f"{name}_rank0.json"
    if not out.exists():
        data = training_data(w, root)
        port = harness.free_port()
        commands = []
        for rank in range(world):
            common = [
                "--rank", str(rank), "--world", str(world), "--master", f"127.0.0.1:{port}",
                "--threads", "1", "--steps", str(steps), "--log-every", str(steps // 10),
                "--data", str(data), "--out", str(root / f"{name}_rank{rank}.json"),
            ]  # fmt: skip
            if w is LM:
                script = "ddp_lm.py"
                extra = [
                    "--batch-per-thread", str(w.rows_per(world)), "--d-model", "64",
                    "--layers", "2", "--heads", "4", "--lr", "8e-3", "--warmup", "0",
                    "--schedule", str(steps // 20), str(steps),
                ]  # fmt: skip
            else:
                script, extra = "ddp_mlp.py", ["--batch", str(w.rows_per(world))]
            commands.append([*_pin(rank // per_machine), sys.executable,
                             str(ROOT / "bench" / script), *common, *extra])  # fmt: skip
        _run(commands, root / f"{name}.log")
    result = json.loads(out.read_text())
    assert result["parameters"] == w.parameters, result
    return Row(float(result["s_per_step"]), result["losses"])


def measure(w: Workload, root: pathlib.Path, steps: int) -> dict[str, Row]:
    return {
        "one": lpdec_row(w, root, 1, "none", steps),
        "none_2": lpdec_row(w, root, 2, "none", steps),
        "allreduce_2": lpdec_row(w, root, 2, "allreduce", steps),
        "allreduce_2_host": lpdec_row(w, root, 2, "allreduce", steps, process_sum="host"),
        "ddp": ddp_row(w, root, steps),
        "none_2x4": lpdec_row(w, root, 1, "none", steps, WORKERS),  # a machine alone
        "allreduce_2x4": lpdec_row(w, root, 2, "allreduce", steps, WORKERS),
        "ddp_8": ddp_row(w, root, steps, per_machine=WORKERS),
    }


def _curve(row: Row, every: int = 2) -> str:
    return " ".join(f"{loss:.3f}" for _, loss in row.losses[every - 1 :: every])


def render(w: Workload, rows: dict[str, Row], steps: int) -> list[str]:
    per_step = w.batch * w.per_row

    def line(label: str, key: str, reference: str) -> str:
        r = rows[key]
        rate = per_step / r.seconds
        return (
            f"| {label} | {r.seconds:.4f} | {r.seconds / rows[reference].seconds:.2f}x | "
            f"{rate:,.0f} | {_curve(r)} |"
        )

    sec = {k: r.seconds for k, r in rows.items()}
    a, none = sec["allreduce_2"], sec["none_2"]
    b, b_none = sec["allreduce_2x4"], sec["none_2x4"]
    marks = ", ".join(str(s) for s, _ in rows["ddp"].losses[1::2])
    return [
        f"### {w.title}; {per_step:,} {w.unit} a step in all",
        "",
        f"| run | seconds per step | against DDP in its layout | {w.unit} per second | "
        f"training loss at steps {marks} |",
        "|---|---|---|---|---|",
        line(f"lpdec, one process, {per_step:,} {w.unit}", "one", "ddp"),
        line(
            f"lpdec, 2 processes, no exchange (compute and dispatch of {per_step // 2:,} "
            f"{w.unit} each)",
            "none_2",
            "ddp",
        ),  # fmt: skip
        line(
            "layout (a): lpdec, 2 processes, fp32 all-reduce of the gradients through jax's "
            "gloo (`config.process_sum='jax'`)",
            "allreduce_2",
            "ddp",
        ),  # fmt: skip
        line(
            "layout (a): lpdec, 2 processes, the same all-reduce through lpdec.host_sum "
            "(`config.process_sum='host'`)",
            "allreduce_2_host",
            "ddp",
        ),  # fmt: skip
        line("layout (a): PyTorch DDP, 2 processes (gloo, buckets)", "ddp", "ddp"),
        line(
            f"layout (b): lpdec, one machine alone: a process of {WORKERS} devices, its "
            f"half of the step, no exchange" + (" (FSDP's gathers inside)" if w is LM else ""),
            "none_2x4",
            "ddp_8",
        ),
        line(
            f"layout (b): lpdec, 2 processes of {WORKERS} devices"
            + (", the model split over them (FSDP)" if w is LM else ", a mean inside each")
            + ", fp32 all-reduce between the machines",
            "allreduce_2x4",
            "ddp_8",
        ),  # fmt: skip
        line(
            f"layout (b): PyTorch DDP, {MACHINES * WORKERS} processes (one per worker, "
            f"{WORKERS} on each core)",
            "ddp_8",
            "ddp_8",
        ),  # fmt: skip
        "",
        "Where lpdec's 2-process step goes, from the rows' differences: layout (a): "
        f"compute, dispatch and per-step Python of a half {none:.4f} s "
        f"({100 * none / a:.0f}%), the all-reduce across the processes with its "
        f"synchronisation {a - none:.4f} s ({100 * (a - none) / a:.0f}%; through "
        f"lpdec.host_sum {sec['allreduce_2_host'] - none:.4f} s); layout (b): the "
        f"half's compute on {WORKERS} devices of one core with the collectives inside the "
        f"process {b_none:.4f} s ({100 * b_none / b:.0f}%; {b_none - none:+.4f} s against "
        f"(a)'s one device), the all-reduce across the processes {b - b_none:.4f} s "
        f"({100 * (b - b_none) / b:.0f}%). One process doing the whole step: "
        f"{sec['one']:.4f} s, {sec['one'] / none:.2f}x a half's. A loss is the mean over the "
        "interval ending at that step and over the processes.",
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/lpdec_bench_step_parity")
    parser.add_argument("--workloads", default="lm,mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false",
        help="no taskset: each process one compute thread, on whichever core the OS "
        "gives it (its own section: jax's gloo all-reduce stalls when its process has "
        "one core, bench/collective_overlap.py)",
    )  # fmt: skip
    parser.add_argument(
        "--section",
        help="the BENCHMARKS.md section to write (default: 'bench/step_parity.py', with "
        "--no-pin 'bench/step_parity.py unpinned'): a re-run on another machine beside "
        "the first",
    )  # fmt: skip
    args = parser.parse_args(argv)
    global PIN
    PIN = args.pin
    root = pathlib.Path(args.workdir) / ("pinned" if args.pin else "unpinned")
    root.mkdir(parents=True, exist_ok=True)
    workloads = [WORKLOADS[name] for name in args.workloads.split(",")]
    results = {w.name: measure(w, root, args.steps) for w in workloads}
    (root / "results.json").write_text(
        json.dumps(
            {k: {r: dataclasses.asdict(v) for r, v in rows.items()} for k, rows in results.items()},
            indent=1,
        )  # fmt: skip
    )
    where = (
        "Every process pinned to its machine's core (`taskset -c`)"
        if args.pin
        else "No process pinned (the OS places them; `--no-pin`), each"
    )
    lines = [
        "## The step across processes, like for like (`bench/step_parity.py"
        + ("" if args.pin else " --no-pin")
        + "`)"
        + (f", {time.strftime('%Y-%m-%d')}" if args.section else ""),
        "",
        "2 machines on loopback; layout (a): one process per machine holding the whole "
        f"model; layout (b): a machine's {WORKERS} workers as devices of one process "
        f"(lpdec) or as {WORKERS} processes (DDP). {where} with one compute thread (XLA's "
        "eigen pool off, `intra_op_parallelism_threads=1`; `torch.set_num_threads(1)`). "
        f"Median seconds per step over {args.steps} steps after the first logged interval. "
        f"`python -m bench.step_parity{'' if args.pin else ' --no-pin'}"
        + (f" --section '{args.section}'" if args.section else "")
        + f"`; {versions()}, "
        f"{os.cpu_count()} cores.",
        "",
    ]
    for w in workloads:
        lines += render(w, results[w.name], args.steps)
    body = "\n".join(lines).rstrip()
    print(body)
    if not args.no_write:
        marker = args.section or "bench/step_parity.py" + ("" if args.pin else " unpinned")
        replace_section(ROOT / "BENCHMARKS.md", marker, body, header=BENCHMARKS_HEADER)


if __name__ == "__main__":
    main()
