"""Training across a real, shaped network link: P processes of train.py in network namespaces.

    python -m bench.link --rates 100mbit,1gbit --processes 2,4 --devices 4 --steps 400 \\
        --target 0.7                       # the full benchmark: BENCHMARKS.md + docs/ plot
    python -m bench.link --quick --output /tmp/link.md --plot /tmp/link.png   # a smoke run
    python -m bench.link --cleanup         # removes namespaces left by a killed run

Needs root and iproute2 (`ip`, `tc` with htb). For each process count P it
makes P network namespaces joined by veth links (`bench/netns.py`: a veth pair
for 2 hosts, a bridge namespace for more; addresses 10.77.x.0/24 inside those
namespaces only) and runs, for each method, P processes of `train.py`
(`configs/link_mlp.py` plus the method's overrides), one per namespace with k
CPU devices each, gloo collectives, the coordinator at host 0's address.

What is measured, per method:

* Link bytes per step: host 0's veth transmit counter, read before and after
  two short runs on the unshaped link of N1 and N2 steps (`--probe-steps`), each
  one compiled chunk and one evaluation (`log_every` = its length). The
  difference over N2 - N1 steps cancels start-up, connection set-up, the one
  evaluation and the final checkpoint, which both runs share. Beside it: the
  bytes train.py's traffic meter says a host puts on the link per step
  (`link_share`: `link_bytes_by_axis`, each collective by its bandwidth-optimal
  algorithm, `lpdec.wire.LINK_SHARE`). The two should agree up to TCP/IP's
  headers and acknowledgements.
* Seconds per step: the median of `step_time_s` over the metrics.csv rows but
  the first (the warm-up) of a `--steps` run, on the unshaped link and at each
  rate (each row times one compiled chunk of `--log-every` steps; evaluation
  and compilation are not in it).
* Compute utilisation: unshaped seconds per step / shaped seconds per step.
* Time to target: training time (`step_time_s` x steps, summed over rows) at
  the first row whose node-averaged model reaches `--target` test accuracy;
  speed-up: fp32 all-reduce's time to target / the method's.
* Final accuracy: the node-averaged model's test accuracy at the last row.

Every run is bounded by `--timeout` (its process groups are killed), and the
namespaces are removed on exit, on SIGINT/SIGTERM/SIGHUP and at interpreter
exit. Results go to a JSON file, a section of `--output` (BENCHMARKS.md by
default) and a plot of test accuracy against training time (`--plot`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

from bench import _sections
from bench import harness
from bench import netns
from bench.link_report import BASELINE
from bench.link_report import UNSHAPED
from bench.link_report import curve
from bench.link_report import plot
from bench.link_report import section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "bench/link.py"
FIRST_PORT = 23456


class Method(NamedTuple):
    """A benchmarked method: its table label and the train.py config fields it sets."""

    label: str
    overrides: dict


#: Every method the harness knows, by command-line name. The fp32 all-reduce is
#: the baseline of the speed-up column. The hierarchical methods average in full
#: precision inside a machine (a process) and compress only between machines.
METHODS = {
    "allreduce": Method("fp32 all-reduce", {"algorithm": "allreduce"}),
    "dpsgd": Method("fp32 D-PSGD", {"algorithm": "dpsgd"}),
    "cmean8": Method(
        "compressed mean 8-bit", {"algorithm": "compressed_mean", "compressor": "minmax", "bits": 8}
    ),
    "cmean4": Method(
        "compressed mean 4-bit", {"algorithm": "compressed_mean", "compressor": "minmax", "bits": 4}
    ),
    "choco8": Method(
        "CHOCO 8-bit", {"algorithm": "choco", "compressor": "minmax", "bits": 8, "gamma": 1.0}
    ),
    "choco4": Method(
        "CHOCO 4-bit", {"algorithm": "choco", "compressor": "minmax", "bits": 4, "gamma": 0.8}
    ),
    "choco2": Method(
        "CHOCO 2-bit", {"algorithm": "choco", "compressor": "minmax", "bits": 2, "gamma": 0.4}
    ),
    "hmean8": Method(
        "hierarchical mean 8-bit",
        {"algorithm": "compressed_mean", "compressor": "minmax", "bits": 8, "hierarchical": True},
    ),
    "hmean4": Method(
        "hierarchical mean 4-bit",
        {"algorithm": "compressed_mean", "compressor": "minmax", "bits": 4, "hierarchical": True},
    ),
    "hchoco8": Method(
        "hierarchical CHOCO 8-bit",
        {
            "algorithm": "choco",
            "compressor": "minmax",
            "bits": 8,
            "gamma": 1.0,
            "hierarchical": True,
        },
    ),
    "hchoco4": Method(
        "hierarchical CHOCO 4-bit",
        {
            "algorithm": "choco",
            "compressor": "minmax",
            "bits": 4,
            "gamma": 0.8,
            "hierarchical": True,
        },
    ),
    # theta 1.0 and 0.5 (nearest rounding) diverge on configs/link_mlp.py; 0.1 with stochastic
    # rounding and slack 0.5 trains close to D-PSGD (68.8% vs 71.8% after 200 steps).
    "moniqua2": Method(
        "Moniqua 2-bit",
        {"algorithm": "moniqua", "bits": 2, "theta": 0.1, "rounding": "stochastic", "slack": 0.5},
    ),
}


def _diloco(label: str, exchange: str, local_steps: int = 10, **fields) -> Method:
    """DiLoCo (issue 12): `local_steps` Nesterov SGD steps, then `exchange` and the outer step."""
    overrides = {"algorithm": "diloco", "local_steps": local_steps, "exchange": exchange}
    return Method(label, overrides | fields)


_EF4 = {"compressor": "minmax", "bits": 4, "error_feedback": True}
_EF2 = {"compressor": "minmax", "bits": 2, "error_feedback": True}
METHODS |= {
    "diloco32": _diloco("DiLoCo H=10, fp32 mean", "mean"),
    "diloco4": _diloco("DiLoCo H=10, 4-bit EF mean", "compressed_mean", **_EF4),
    "diloco2": _diloco("DiLoCo H=10, 2-bit EF mean", "compressed_mean", **_EF2),
    "diloco4ov": _diloco(
        "DiLoCo H=10, 4-bit EF mean, overlap", "compressed_mean", overlap=True, **_EF4
    ),
    "hdiloco4": _diloco(
        "DiLoCo H=10, hierarchical 4-bit EF", "compressed_mean", hierarchical=True, **_EF4
    ),
    "dilocochoco4": _diloco(
        "DiLoCo H=10, CHOCO 4-bit gossip", "gossip", compressor="minmax", bits=4, gamma=0.8
    ),
    "diloco4h20": _diloco("DiLoCo H=20, 4-bit EF mean", "compressed_mean", 20, **_EF4),
    "diloco4h40": _diloco("DiLoCo H=40, 4-bit EF mean", "compressed_mean", 40, **_EF4),
}  # fmt: skip

#: The language-model workload (`--workload lm`, configs/lm_study.py: the language-model
#: study's recipe): every method runs with each machine's model split over its workers
#: (FSDP) and exchanges between the machines only, so the fp32 all-reduce crosses the link
#: once per step. Each method runs at its tuned setting (EXPERIMENTS.md, "lm"): Adam 8e-3
#: (both sweeps' winner), DiLoCo's outer Nesterov 0.7 / 0.6 (its sweep's winner) from
#: the config; the methods the study did not tune (the per-step compressed means) run
#: at the all-reduce's rate and say so.
_PER_STEP = {"local_steps": 1, "error_feedback": False, "outer_warmup_rounds": 0}
_LM_EF = {"local_steps": 20, "compressor": "minmax", "error_feedback": True,
          "exchange": "compressed_mean", "outer_warmup_rounds": 10}  # fmt: skip
_SPARSE = dict(_LM_EF, compressor="chunked_top_k", chunk_size=4096, bits=2)
LM_METHODS = {
    "allreduce": Method(
        "fp32 all-reduce (FSDP, hierarchical)", {"algorithm": "allreduce", **_PER_STEP}
    ),
    # The study's best: +0.95% over 3 seeds at 1/53 of the all-reduce's bytes.
    "diloco4h10": Method(
        "DiLoCo H=10, 4-bit EF, momentum warm-up",
        {"algorithm": "diloco", "bits": 4, **_LM_EF, "local_steps": 10, "outer_warmup_rounds": 20},
    ),
    # Half its bytes: H=20, the outer step tuned again under the warm-up (+1.52%).
    "diloco4": Method(
        "DiLoCo H=20, 4-bit EF, momentum warm-up, outer 0.7 / 0.8",
        {"algorithm": "diloco", "bits": 4, **_LM_EF, "outer_momentum": 0.8},
    ),
    "diloco2": Method(
        "DiLoCo H=20, 2-bit EF, momentum warm-up", {"algorithm": "diloco", "bits": 2, **_LM_EF}
    ),
    "cmean4": Method(
        "compressed mean 4-bit (the all-reduce's rate)",
        {"algorithm": "compressed_mean", "compressor": "minmax", "bits": 4, **_PER_STEP},
    ),
    "choco8": Method(
        "CHOCO 8-bit (the all-reduce's rate)",
        {"algorithm": "choco", "compressor": "minmax", "bits": 8, "gamma": 1.0, **_PER_STEP},
    ),
    # SparseLoCo's compressor: 64 of every 4096 values at 2 bits (0.029 bytes per value);
    # and at the bytes of 2-bit min-max (0.251 per value): 560 of 4096.
    "dilocosparse": Method(
        "DiLoCo H=20, top-64/4096 2-bit EF, momentum warm-up",
        {"algorithm": "diloco", "ratio": 64 / 4096, **_SPARSE},
    ),
    # SparseLoCo as its paper runs it: the top-64/4096 2-bit payloads all-gathered and
    # averaged (not compressed again), the residual decayed by 0.95 in place of the
    # outer momentum, a plain outer step of 1.
    "sparseloco": Method(
        "SparseLoCo (H=20, top-64/4096 2-bit, all-gather, EF 0.95)",
        {
            "algorithm": "diloco",
            "ratio": 64 / 4096,
            "mean_rounds": 1,
            "error_decay": 0.95,
            "outer_momentum": 0.0,
            "outer_lr": 1.0,
            **_SPARSE,
            "outer_warmup_rounds": 0,
        },
    ),  # fmt: skip
    "dilocosparse2eq": Method(
        "DiLoCo H=20, top-560/4096 2-bit EF (2-bit min-max's bytes), momentum warm-up",
        {"algorithm": "diloco", "ratio": 560 / 4096, **_SPARSE},
    ),
}


class Workload(NamedTuple):
    """What a benchmark trains and how its quality is read from metrics.csv."""

    config: str
    methods: dict
    metric: str  # the node-averaged model's column of metrics.csv
    lower_is_better: bool
    metric_name: str
    tokens: bool = False  # the tables add tokens per second a machine


WORKLOADS = {
    "mlp": Workload(
        os.path.join(ROOT, "configs", "link_mlp.py"),
        METHODS,
        "test_accuracy_avg_model",
        False,
        "test accuracy",
    ),
    "lm": Workload(
        os.path.join(ROOT, "configs", "lm_study.py"),
        LM_METHODS,
        "val_bits_per_byte_avg_model",
        True,
        "validation bits per byte",
        tokens=True,
    ),
}


#: --quick's model and data per workload: a run takes seconds (the language model is
#: small already). One node per device: `measure` sets num_nodes to processes x devices.
QUICK_FIELDS = {
    "mlp": ["dataset=synthetic", "num_samples=1200", "model_kwargs.hidden_sizes=(256,)"],
    "lm": [],
}


class RunFailed(RuntimeError):
    """A training run exited with an error or ran past its time limit."""


@dataclasses.dataclass
class Run:
    """One finished run of P train.py processes."""

    rows: list[dict]  # metrics.csv, as floats
    summary: dict
    tx_bytes: int  # host 0's veth counters over the run
    rx_bytes: int
    wall_s: float


# --pin: each process on one core of its own with one thread (bench/step_parity.py's
# like-for-like setting), so that neither lpdec nor DDP oversubscribes the cores.
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


class Pinned:
    """`network` with each host's commands pinned to core host % cores (`taskset -c`)."""

    pinned = True

    def __init__(self, network):
        self.network = network

    def __getattr__(self, name):
        return getattr(self.network, name)

    def exec_prefix(self, host: int) -> list[str]:
        core = host % (os.cpu_count() or 1)
        return self.network.exec_prefix(host) + ["taskset", "-c", str(core)]


def train_command(network, host, workdir, port, config, overrides) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    return network.exec_prefix(host) + [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        f"--config={config}",
        f"--workdir={workdir}",
        f"--coordinator_address={network.address(0)}:{port}",
        f"--num_processes={network.hosts}",
        f"--process_id={host}",
    ] + flags  # fmt: skip


def run_training(network, workdir, port, devices, config, overrides, timeout) -> Run:
    """Runs one process of train.py per host of `network` and waits at most `timeout` s."""
    commands = [
        train_command(network, host, workdir, port, config, overrides)
        for host in range(network.hosts)
    ]
    wall, tx, rx = run_hosts(network, workdir, commands, devices, timeout)
    with open(os.path.join(workdir, "metrics.csv")) as f:
        # An empty cell is a column this run does not compute (e.g. eval_local_examples=0).
        rows = [{k: float(v or "nan") for k, v in row.items()} for row in csv.DictReader(f)]
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    return Run(rows, summary, tx, rx, wall)


def run_hosts(network, workdir, commands, devices, timeout) -> tuple[float, int, int]:
    """Runs `commands[h]` on host h of `network`; (wall seconds, host 0's tx and rx bytes)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if getattr(network, "pinned", False):
        env["XLA_FLAGS"] += " " + ONE_THREAD
        env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = ROOT
    os.makedirs(workdir, exist_ok=True)
    tx0, rx0 = network.counters(0)
    started = time.time()
    procs = []
    for host, command in enumerate(commands):
        procs.append(harness.start(command, os.path.join(workdir, f"process{host}.log"), env))
        netns.CHILDREN.append(procs[-1])
    try:
        ended = harness.wait_all(procs, timeout - (time.time() - started))
    finally:
        for proc in procs:
            netns.CHILDREN.remove(proc)
    if not ended:
        raise RunFailed(f"{workdir}: ran past --timeout={timeout} s")
    wall = time.time() - started
    tx1, rx1 = network.counters(0)
    # Report a process that failed by itself before one that was killed for it (code < 0).
    failed = sorted((-proc.returncode, host) for host, proc in enumerate(procs) if proc.returncode)
    if failed:
        code, host = -failed[0][0], failed[0][1]
        with open(os.path.join(workdir, f"process{host}.log")) as f:
            tail = [line.strip() for line in f.read().splitlines() if line.strip()]
        raise RunFailed(f"process {host} exited with {code}: {tail[-1] if tail else ''}")
    return wall, tx1 - tx0, rx1 - rx0


def load_config(path: str):
    """The `get_config()` of the config file at `path` (train.py's --config)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # configs import each other as `configs.<name>`
    spec = importlib.util.spec_from_file_location("_link_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def link_share(summary: dict, devices: int) -> float:
    """The bytes a host puts on the link per step, by train.py's traffic meter: its
    `devices` nodes' link bytes on the machines axis (the workers' axis stays inside
    the host), or one node's when the run has no machines axis (a node a host). It
    reads the summary of a run `measure` has just made (results files from before the
    link model keep their operand bytes: `link_report.modelled_cell`)."""
    by_axis = summary["link_bytes_by_axis"]
    if "machines" in by_axis:
        return float(by_axis["machines"]) * devices
    return float(summary["link_bytes_per_step"])


def ddp_layout(args, hosts: int) -> tuple[int, int, int]:
    """DDP's (processes a host, threads a process, a host's rows a step) on `hosts` hosts.

    A host runs one process holding its batch (the whole model per machine) or, with
    --ddp-per-worker, one per device with a device's batch; a process has a thread per
    device it stands for (one with --pin or a process per worker). Raises SystemExit
    with one line when the host's rows do not split evenly over its threads (DDP would
    train on fewer rows than lpdec)."""
    config = load_config(args.config)
    batch = int(args.set.get("batch_size", config.batch_size))  # rows per worker and step
    nodes = int(args.set.get("num_nodes", config.num_nodes))
    if args.quick:  # as `measure` sets it
        nodes = int(args.set.get("num_nodes", hosts * args.devices))
    rows = batch * nodes // hosts
    per_host = args.devices if args.ddp_per_worker else 1
    threads = 1 if args.pin or per_host > 1 else args.devices
    if args.workload == "lm" and rows % (per_host * threads):
        raise SystemExit(
            f"error: DDP: a host's {rows} windows a step do not split over its "
            f"{per_host * threads} threads ({per_host} processes x {threads}); change "
            "--set batch_size or --devices"
        )
    if args.workload != "lm" and rows % per_host:
        raise SystemExit(
            f"error: DDP: a host's {rows} rows a step do not split over its {per_host} "
            "processes (--ddp-per-worker); change --set batch_size or --devices"
        )
    return per_host, threads, rows


def measure_ddp(network, args, port, workdir, baseline: dict) -> dict:
    """PyTorch DDP's seconds per step at each rate, on `baseline`'s curve.

    `bench/ddp_lm.py` for the language model, `bench/ddp_mlp.py` for the MLP (with
    `--set norm=none`: its MLP has no norm layers). DDP runs synchronous data-parallel
    SGD, the fp32 all-reduce's algorithm, so its metric after a step is taken as the
    all-reduce's (the unshaped run's); only the time per step is its own. Link bytes:
    the difference of two unshaped runs.
    """

    per_host, threads, rows = ddp_layout(args, network.hosts)

    def run(key, steps):
        here = os.path.join(workdir, f"ddp-{key}-{steps}")
        address = f"{network.address(0)}:{next(port)}"
        commands = [
            network.exec_prefix(host)
            + [
                args.torch_python,
                os.path.join(ROOT, "bench", script),
                f"--rank={host * per_host + local}",
                f"--world={network.hosts * per_host}",
                f"--master={address}",
                f"--threads={threads}",
                f"--steps={steps}",
                *model_flags,
                f"--out={os.path.join(here, f'rank{host * per_host + local}.json')}",
            ]  # fmt: skip
            for host in range(network.hosts)
            for local in range(per_host)
        ]
        _, tx, _ = run_hosts(network, here, commands, args.devices, args.timeout)
        with open(os.path.join(here, "rank0.json")) as f:
            return json.load(f), tx

    config = load_config(args.config)
    if args.workload == "lm":
        script, per_row = "ddp_lm.py", args.ddp_context
        shape = config.model_kwargs
        model_flags = [
            "--warmup=5",
            f"--context={shape.context}",
            f"--d-model={shape.d_model}",
            f"--layers={shape.num_layers}",
            f"--heads={shape.num_heads}",
            f"--lr={config.learning_rate}",
            f"--batch-per-thread={rows // per_host // threads}",  # a process's windows
        ]
    else:
        # train.py's training set (as bench/step_parity.py writes it for PyTorch).
        from bench import step_parity  # noqa: PLC0415 (jax only where DDP runs)

        data = step_parity.training_data(step_parity.MLP, pathlib.Path(workdir))
        script, per_row = "ddp_mlp.py", 1
        model_flags = [
            f"--data={data}",
            "--hidden",
            *(str(width) for width in config.model_kwargs.hidden_sizes),
            f"--lr={float(args.set.get('learning_rate', config.learning_rate))}",
            f"--weight-decay={config.weight_decay}",
            f"--batch={rows // per_host}",
        ]
    label = "PyTorch DDP (gloo), " + (
        f"{per_host} processes per machine (one per worker)"
        if per_host > 1
        else "whole model per machine"
    )
    result = {"method": "ddp", "label": label + (", one thread" if args.pin else "")}
    network.shape(None)
    (_, tx10), (_, tx30) = run(UNSHAPED, 10), run(UNSHAPED, 30)
    result["link_bytes_per_step"] = (tx30 - tx10) / 20
    result["compiled_bytes_per_step"] = float("nan")
    result["modelled_link_bytes_per_step"] = float("nan")
    result["rates"] = {}
    for rate in [None] + args.rates:
        network.shape(rate)
        key = rate or UNSHAPED
        measured, _ = run(key, args.ddp_steps)
        result["torch"] = measured["torch"]
        base = baseline["rates"][UNSHAPED]
        s_per_step = measured["s_per_step"]
        steps_and_values = zip(base["steps"], base["values"], strict=True)
        points = [(step * s_per_step, value) for step, value in steps_and_values]
        result["rates"][key] = {
            "s_per_step": s_per_step,
            "combined": True,
            "final_accuracy": base["values"][-1],
            "curve": points,
            "clock_curve": [],
            "tokens_per_s_per_machine": measured["batch"] * per_host * per_row / s_per_step,
        }
    network.shape(None)
    unshaped = result["rates"][UNSHAPED]["s_per_step"]
    for at in result["rates"].values():
        at["utilisation"] = unshaped / at["s_per_step"]
    return result


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def measure(network, name, args, port, workdir) -> dict:
    """All numbers of one method on `network`: two unshaped probe runs, one run per rate.

    With `--shaped-steps` N > 0 the run at each rate is N steps long, for its seconds per
    step and per evaluation, and that rate's curve is the unshaped run's metrics at those
    times: exact for lpdec's methods, whose every step is synchronous, so what they
    compute does not depend on how long the link takes.
    """
    workload = WORKLOADS[args.workload]
    overrides = dict(workload.methods[name].overrides, **args.set)
    if args.quick:
        overrides.setdefault("num_nodes", network.hosts * args.devices)
    if args.workload == "lm":  # each process is a machine (the config says 2)
        overrides.setdefault("machines", network.hosts)
    # A run that exchanges every H steps is measured over whole rounds: probes, chunks
    # (log rows) and runs are multiples of H, so every row holds the same exchanges.
    h = int(overrides.get("local_steps", 1))
    n1, n2 = (_round_up(n, h) for n in args.probe_steps)
    n2 = max(n2, n1 + h)
    log_every = math.lcm(args.log_every, h)
    steps = _round_up(args.steps, log_every)
    shaped_steps = _round_up(args.shaped_steps, log_every) if args.shaped_steps else steps
    result = {"method": name, "label": workload.methods[name].label, "rates": {}}
    network.shape(None)
    probes = []
    for length in (n1, n2):
        probe = dict(overrides, num_steps=length, log_every=length, checkpoint_every=0)
        probes.append(
            run_training(
                network,
                os.path.join(workdir, f"{name}-probe-{length}"),
                next(port),
                args.devices,
                args.config,
                probe,
                args.timeout,
            )
        )
    a, b = probes
    result["link_bytes_per_step"] = (b.tx_bytes - a.tx_bytes) / (n2 - n1)
    result["link_rx_bytes_per_step"] = (b.rx_bytes - a.rx_bytes) / (n2 - n1)
    result["compiled_bytes_per_step"] = b.summary["final"]["wire_bytes_per_step"]
    result["modelled_link_bytes_per_step"] = link_share(b.summary, args.devices)
    result["wire_bytes_source"] = b.summary["wire_bytes_source"]
    unshaped_rows = None
    for rate in [None] + args.rates:
        network.shape(rate)
        key = rate or UNSHAPED
        length = steps if rate is None else shaped_steps
        run = run_training(
            network,
            os.path.join(workdir, f"{name}-{key}"),
            next(port),
            args.devices,
            args.config,
            dict(overrides, num_steps=length, log_every=log_every, checkpoint_every=0),
            args.timeout,
        )
        # The first row holds the first execution of the chunk (warm-up): the medians skip
        # it when there are other rows.
        timed = run.rows[1:] or run.rows[:1]
        s_per_step = statistics.median(row["step_time_s"] for row in timed)
        eval_s = statistics.median(row.get("eval_time_s", 0.0) for row in timed)
        if rate is None:
            unshaped_rows = run.rows
        rows = run.rows
        if length < steps:
            # The unshaped run's metrics at this link's times.
            rows = [dict(row, step_time_s=s_per_step, eval_time_s=eval_s) for row in unshaped_rows]
        result["rates"][key] = {
            "s_per_step": s_per_step,
            "eval_s_per_row": eval_s,
            "combined": length < steps,
            "final_accuracy": rows[-1][workload.metric],
            "curve": curve(rows, workload.metric),
            "steps": [row["step"] for row in rows],
            "values": [row[workload.metric] for row in rows],
            "clock_curve": curve(rows, workload.metric, clock=True),
            "tokens_per_s_per_machine": statistics.median(
                row.get("tokens_per_s_per_machine", 0.0) for row in timed
            ),
            "wall_s": run.wall_s,
        }
    unshaped = result["rates"][UNSHAPED]["s_per_step"]
    for at in result["rates"].values():
        at["utilisation"] = unshaped / at["s_per_step"]
    network.shape(None)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit", help="tc rates, comma-separated")
    parser.add_argument("--processes", default="2", help="process counts, comma-separated")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
    parser.add_argument("--steps", type=int, default=400, help="steps of each shaped run")
    parser.add_argument("--log-every", type=int, default=20, help="steps per metrics row")
    parser.add_argument("--probe-steps", default="10,30", help="N1,N2: the unshaped runs")
    parser.add_argument(
        "--target",
        help="the target (test accuracy, or bits per byte for lm), or 'final': the fp32 "
        "all-reduce's final value per link (default: 0.7 for mlp, final for lm)",
    )
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="mlp",
        help="mlp: configs/link_mlp.py; lm: the language model, configs/lm_study.py",
    )
    parser.add_argument("--methods", help="comma-separated names (default: the workload's)")
    parser.add_argument("--config", help="the config (default: the workload's)")
    parser.add_argument(
        "--torch-python",
        help="a Python with torch: PyTorch DDP runs beside (bench/ddp_lm.py, or "
        "bench/ddp_mlp.py with --workload mlp --set norm=none)",
    )
    parser.add_argument("--ddp-steps", type=int, default=30, help="timed DDP steps per rate")
    parser.add_argument(
        "--ddp-per-worker",
        action="store_true",
        help="DDP with one process per device of each machine (--devices of them, a "
        "device's batch each, one thread, on the machine's core with --pin): lpdec's "
        "layout of workers; default: one process per machine holding its batch",
    )
    parser.add_argument(
        "--shaped-steps",
        type=int,
        default=0,
        help="steps of each shaped run (0: --steps); the curve is the unshaped run's",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="extra config field"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each process on a core of its own (taskset -c) with one thread: XLA's eigen "
        "pool off, PyTorch's one thread (bench/step_parity.py's like-for-like setting)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--output", default=os.path.join(ROOT, "BENCHMARKS.md"))
    parser.add_argument(
        "--section",
        default=SECTION,
        help="name of the section of --output to write (one per layout, e.g. 'bench/link.py 4x2')",
    )
    parser.add_argument("--plot", default=os.path.join(ROOT, "docs", "link_accuracy_vs_time.png"))
    parser.add_argument("--results", help="JSON of every number (default: in --workdir)")
    parser.add_argument("--workdir", help="run directories (default: a new temporary one)")
    parser.add_argument(
        "--prefix", help="namespace name prefix (default lpdec-<pid>; for --cleanup, lpdec-)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny model, one node per device; defaults 2 x 2 devices, 1gbit",
    )
    parser.add_argument(
        "--cleanup", action="store_true", help="only remove namespaces starting with --prefix"
    )
    parser.add_argument(
        "--from-results",
        metavar="JSON",
        help="run nothing: write the section and plot of a results file again",
    )
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(
            rates="1gbit",
            processes="2",
            devices=2,
            steps=20,
            log_every=5,
            probe_steps="5,15",
            methods="dpsgd,choco8",
        )
    args = parser.parse_args(argv)
    if args.quick:
        args.set = QUICK_FIELDS[args.workload] + args.set
    args.rates = [r for r in args.rates.split(",") if r]
    try:
        args.processes = [int(p) for p in args.processes.split(",")]
        args.probe_steps = tuple(int(s) for s in args.probe_steps.split(","))
    except ValueError:
        parser.error("--processes and --probe-steps take comma-separated integers")
    if args.target is None:
        args.target = "final" if args.workload == "lm" else "0.7"
    if args.target == "final":
        args.target = None
    else:
        try:
            args.target = float(args.target)
        except ValueError:
            parser.error(f"--target={args.target!r}: expected a number or 'final'")
    workload = WORKLOADS[args.workload]
    if args.methods is None:
        args.methods = ",".join(workload.methods)
    if args.config is None:
        args.config = workload.config
    args.methods = [m for m in args.methods.split(",") if m]
    if args.target is None and BASELINE not in args.methods:
        parser.error(f"--target=final needs the baseline {BASELINE!r} in --methods")
    unknown = [m for m in args.methods if m not in workload.methods]
    if unknown:
        parser.error(f"--methods: {unknown} not among {sorted(workload.methods)}")
    args.ddp_context = 64
    if args.torch_python and args.workload == "mlp" and "norm=none" not in args.set:
        parser.error(
            "--torch-python with --workload mlp needs --set norm=none "
            "(bench/ddp_mlp.py's MLP has no norm layers: like for like)"
        )
    if args.shaped_steps < 0:
        parser.error(f"--shaped-steps={args.shaped_steps} must be >= 0")
    if not args.rates:
        parser.error("--rates: expected at least one tc rate such as 100mbit")
    if any(p < 2 for p in args.processes):
        parser.error(f"--processes={args.processes}: a link needs at least 2 processes")
    if len(args.probe_steps) != 2 or not 0 < args.probe_steps[0] < args.probe_steps[1]:
        parser.error(f"--probe-steps={args.probe_steps}: expected N1,N2 with 0 < N1 < N2")
    if args.steps < 1 or args.log_every < 1 or args.steps % args.log_every:
        parser.error(f"--steps={args.steps} must be a positive multiple of --log-every")
    if any("=" not in s for s in args.set):
        parser.error(f"--set: expected FIELD=VALUE, got {args.set}")
    args.set = dict(s.split("=", 1) for s in args.set)
    args.config = os.path.abspath(args.config)
    args.output, args.plot = os.path.abspath(args.output), os.path.abspath(args.plot)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cleanup:
        removed = netns.cleanup(args.prefix or "lpdec-")
        print(f"removed {len(removed)} namespaces: {' '.join(removed)}")
        return 0
    if args.from_results:
        with open(args.from_results) as f:
            data = json.load(f)
        saved = argparse.Namespace(**dict(data["args"], output=args.output, plot=args.plot))
        all_results = {int(p): results for p, results in data["results"].items()}
        workload = WORKLOADS[saved.workload]
        body = section(all_results, saved, data.get("command", "python -m bench.link"), workload)
        header = _sections.BENCHMARKS_HEADER
        _sections.replace_section(args.output, args.section, body, header=header)
        plot(all_results, saved, workload)
        print(body)
        return 0
    if args.torch_python:  # (DDP's batch split checked before anything trains)
        for processes in args.processes:
            ddp_layout(args, processes)
    prefix = args.prefix or f"lpdec-{os.getpid()}"
    reason = netns.unavailable()
    if reason:
        print(f"error: cannot make network namespaces: {reason}", file=sys.stderr)
        return 2
    command = "python -m bench.link " + " ".join(sys.argv[1:] if argv is None else argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="lpdec_link_")
    port = iter(range(FIRST_PORT, FIRST_PORT + 10_000))
    netns.install_cleanup()
    all_results: dict[int, list[dict]] = {}
    results_path = args.results or os.path.join(workdir, "link_results.json")

    def save() -> None:
        # After every method: a run stopped later still renders with --from-results.
        with open(results_path, "w") as f:
            record = {"args": vars(args), "command": command, "results": all_results}
            json.dump(record, f, indent=2, default=str)

    try:
        for processes in args.processes:
            made = netns.Network(processes, f"{prefix}-p{processes}", os.getpid() % 256)
            netns.NETWORKS.append(made)
            made.create()
            network = Pinned(made) if args.pin else made
            print(f"{processes} hosts: namespaces {' '.join(network.names)}", flush=True)
            results = all_results.setdefault(processes, [])
            for name in args.methods:
                print(f"[{processes} processes] {name} ...", flush=True)
                try:
                    results.append(
                        measure(network, name, args, port, os.path.join(workdir, f"p{processes}"))
                    )
                except RunFailed as error:
                    label = WORKLOADS[args.workload].methods[name].label
                    results.append({"method": name, "label": label,
                                    "error": str(error)})  # fmt: skip
                print(json.dumps(results[-1], default=str)[:400], flush=True)
                save()
            baseline = next((r for r in results if r["method"] == BASELINE), None)
            if args.torch_python and baseline is not None and "error" not in baseline:
                print(f"[{processes} processes] PyTorch DDP ...", flush=True)
                try:
                    results.append(
                        measure_ddp(
                            network, args, port, os.path.join(workdir, f"p{processes}"), baseline
                        )
                    )
                except Exception as error:  # noqa: BLE001 - a baseline's failure is a table row
                    results.append({"method": "ddp", "label": "PyTorch DDP", "error": str(error)})
                print(json.dumps(results[-1], default=str)[:400], flush=True)
                save()
            made.destroy()
            netns.NETWORKS.remove(made)
    except netns.Interrupted as signame:
        print(f"interrupted by {signame}: removing namespaces", file=sys.stderr, flush=True)
        netns.teardown()
        return 130
    finally:
        netns.teardown()
    save()
    body = section(all_results, args, command, WORKLOADS[args.workload])
    _sections.replace_section(args.output, args.section, body, header=_sections.BENCHMARKS_HEADER)
    plot(all_results, args, WORKLOADS[args.workload])
    print(body)
    print(f"results: {results_path}; section: {args.output}; plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
