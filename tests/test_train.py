"""train.py end to end: smoke run, exact resume, bad configs, nested nodes, multi-host."""

import csv
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import optax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lpdec  # noqa: E402
import train  # noqa: E402
import train_lib  # noqa: E402
from bench import harness  # noqa: E402
from configs import default  # noqa: E402
from train_lib import ConfigError  # noqa: E402
from train_lib import optimizers  # noqa: E402
from train_lib import registry  # noqa: E402
from train_lib import setup  # noqa: E402
from train_lib import tables  # noqa: E402


def tiny_config(**overrides):
    """A config that trains in seconds: synthetic data, an MLP, 8 nodes, 8-bit CHOCO."""
    config = default.get_config()
    config.dataset = "synthetic"
    config.num_samples = 1200
    config.model = "mlp"
    config.model_kwargs.hidden_sizes = (32,)
    config.precision = "int8"
    config.algorithm = "choco"
    config.num_steps = 40
    config.log_every = 10
    config.checkpoint_every = 10
    config.learning_rate = 0.05
    config.save_final_params = True
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_run(shared_run, **overrides):
    """tiny_config(**overrides) trained in this process once per test run, for every test
    that asks (conftest.shared_run): its workdir, to read or to copy, and its summary."""
    name = "tiny" + "".join(f"-{key}={value}" for key, value in sorted(overrides.items()))
    return shared_run(name, lambda d: train.train_and_evaluate(tiny_config(**overrides), str(d)))


def final_params(workdir):
    with np.load(os.path.join(workdir, "final_params.npz")) as f:
        return {k: f[k] for k in f.files}


def test_smoke_run_writes_metrics_tensorboard_checkpoints_and_summary(shared_run):
    workdir, summary = tiny_run(shared_run)
    assert summary["steps"] == 40 and not summary["halted"]
    with open(workdir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40]
    # A loss that only falls: no jump, and no warning.
    assert [r["loss_jump"] for r in rows] == ["0"] * 4 and summary["loss_jumps"] == []
    final = summary["final"]
    # 4 balanced classes: chance is 0.25; a trained model does much better.
    assert final["test_accuracy_avg_model"] > 0.6
    assert final["consensus_distance"] < 1.0
    assert final["wire_bytes_per_step"] > 0
    assert final["nonfinite_updates"] == 0 and final["nonfinite_received"] == 0
    assert os.listdir(workdir / "tensorboard")
    assert sorted(os.listdir(workdir / "checkpoints")) == ["30", "40"]
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 40


def test_no_local_evaluation_leaves_its_metrics_out(tmp_path):
    """config.eval_local_examples = 0 evaluates only the node-averaged model: the nodes'
    own models' metrics are absent (an empty cell in metrics.csv), never NaN."""
    summary = train.train_and_evaluate(
        tiny_config(eval_local_examples=0, num_steps=10, checkpoint_every=0), str(tmp_path)
    )
    assert summary["steps"] == 10
    final = summary["final"]
    assert "test_accuracy_local_mean" not in final
    # 4 balanced classes: chance is 0.25.
    assert final["test_accuracy_avg_model"] > 0.3
    with open(tmp_path / "metrics.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["test_accuracy_local_mean"] == "" and float(row["test_accuracy_avg_model"]) > 0.3

    def refuse(constant):
        raise AssertionError(f"summary.json holds {constant}")

    json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)


DILOCO = {"algorithm": "diloco", "optimizer": "adam", "learning_rate": 0.01, "local_steps": 3}


@pytest.mark.parametrize(
    "overrides",
    [{}, DILOCO, DILOCO | {"exchange": "compressed_mean", "error_feedback": True, "overlap": True}],
    ids=["choco", "diloco-mid-round", "diloco-ef-overlap-mid-round"],
)
def test_kill_and_resume_gives_the_same_final_parameters(tmp_path, shared_run, overrides):
    """A run stopped after step 20 (right after its checkpoint) and restarted ends
    bit-identical to a run that was never interrupted (DiLoCo: step 20 is in the middle
    of its 7th round of 3 local steps, so the anchor, round start and pending outer
    update must all come back). The two runs of CHOCO are tests/test_reliability.py's."""
    resumed = tmp_path / "resumed"
    straight, _ = tiny_run(shared_run, **overrides)
    halted, first = tiny_run(shared_run, halt_after_steps=20, **overrides)
    shutil.copytree(halted, resumed)
    assert first["halted"] and first["steps"] == 20
    second = train.train_and_evaluate(tiny_config(**overrides), str(resumed))
    assert second["steps"] == 40 and not second["halted"]
    # It resumed (rather than starting over, which would also end equal).
    assert first["resumed_from_step"] == 0 and second["resumed_from_step"] == 20
    a, b = final_params(straight), final_params(resumed)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    with open(resumed / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [10, 20, 30, 40]


TINY_FLAGS = [
    "--config.dataset=synthetic",
    "--config.num_samples=1200",
    "--config.model=mlp",
    "--config.precision=int8",
    "--config.num_steps=20",
    "--config.log_every=10",
    "--config.checkpoint_every=10",
    "--config.learning_rate=0.05",
    "--config.save_final_params=True",
]


# The 60-step run of bench/faults/common.py (its TRAIN_FLAGS), whose uninterrupted run
# tests/test_faults.py shares (straight_process_run).
PROCESS_FLAGS = TINY_FLAGS[:-5] + [
    "--config.algorithm=choco",
    "--config.num_steps=60",
    "--config.log_every=10",
    "--config.checkpoint_every=10",
    "--config.learning_rate=0.05",
    "--config.save_final_params=True",
]


def _train_to_the_end(workdir):
    base = [sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'default.py'}"]
    subprocess.run(
        base + [f"--workdir={workdir}"] + PROCESS_FLAGS,
        env=_env(8),
        check=True,
        capture_output=True,
        cwd=ROOT,
        timeout=600,
    )


def straight_process_run(shared_run):
    """The workdir of train.py run to the end on PROCESS_FLAGS in a process of 8 devices,
    once per test run (conftest.shared_run)."""
    return shared_run("train.py-60-steps", _train_to_the_end)[0]


def test_a_process_killed_mid_run_resumes_to_the_same_parameters(tmp_path, shared_run):
    """SIGKILL a real training process once a checkpoint exists; the restarted run ends
    bit-identical to an uninterrupted one."""
    flags = PROCESS_FLAGS
    base = [sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'default.py'}"]
    straight, killed = straight_process_run(shared_run), tmp_path / "killed"
    proc = subprocess.Popen(
        base + [f"--workdir={killed}"] + flags,
        env=_env(8),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    checkpoint = killed / "checkpoints" / "20"
    deadline = time.time() + 300
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert checkpoint.exists(), "no checkpoint appeared before the run ended"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "final_params.npz").exists()
    _train_to_the_end(killed)
    # It resumed from a checkpoint (20 or later: the kill may land after a later one).
    resumed = json.loads((killed / "summary.json").read_text())["resumed_from_step"]
    assert resumed >= 20 and resumed % 10 == 0, resumed
    a, b = final_params(straight), final_params(killed)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_more_nodes_than_devices_are_simulated_with_vmap(tmp_path):
    summary = train.train_and_evaluate(
        tiny_config(num_nodes=16, algorithm="dcd", save_final_params=False), str(tmp_path)
    )
    assert summary["nodes_per_device"] == 2
    assert summary["final"]["test_accuracy_avg_model"] > 0.6


@pytest.mark.parametrize(
    "overrides",
    [
        {"optimizer": "qg_momentum", "lr_schedule": "constant"},
        {"optimizer": "adam", "algorithm": "moniqua", "theta": 0.5, "theta_follows_lr": True},
        {"algorithm": "compressed_mean", "devices": 2, "hierarchical": True},
        {"algorithm": "choco", "devices": 2, "hierarchical": True},
        {"algorithm": "moniqua", "machines": 4, "hierarchical": True},
        DILOCO | {"num_nodes": 16},
        DILOCO | {"exchange": "gossip", "compressor": "minmax", "bits": 4, "gamma": 0.5},
        DILOCO | {"exchange": "gossip", "machines": 2, "hierarchical": True},
        DILOCO | {"exchange": "compressed_mean", "bits": 4, "error_feedback": True},
        DILOCO | {"exchange": "compressed_mean", "machines": 2, "hierarchical": True},
    ],
    ids=[
        "qgm-constant-lr",
        "adam-moniqua-theta-schedule",
        "hierarchical-2x4",
        "hierarchical-choco-2x4-nested",
        "hierarchical-moniqua-4x2-machines",
        "diloco-mean-nested",
        "diloco-choco4",
        "diloco-hierarchical-choco-2x4",
        "diloco-ef4",
        "diloco-hierarchical-cmean-2x4",
    ],
)
def test_optimizers_algorithms_and_layouts_train(tmp_path, overrides):
    """Combinations whose state types once broke the scan (a constant learning rate kept
    in the optimizer state) or that use a 2-level layout (seed 004's hierarchy)."""
    config = tiny_config(num_steps=20, save_final_params=False, **overrides)
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["final"]["test_accuracy_avg_model"] > 0.4
    # The summary counts the devices the run used, not the machine's.
    assert summary["devices"] == (overrides.get("devices") or jax.device_count())


BAD_CONFIGS = [
    ({"algorithm": "gossip"}, "config.algorithm='gossip' is not one of"),
    ({"topology": "torus", "torus_rows": 3}, "torus_rows=3 does not divide config.num_nodes=8"),
    ({"algorithm": "choco", "topology": "one_peer_exponential"}, "static topology"),
    ({"skew": 1.5}, r"config.skew=1.5 must be in \[0, 1\]"),
    (
        {"dataset": "cifar10", "data_dir": "/nonexistent/cifar"},
        "config.data_dir='/nonexistent/cifar'",
    ),
    ({"dataset": "cifar10", "data_dir": ""}, "needs config.data_dir"),
    ({"model": "resnet999"}, "config.model='resnet999' is not one of"),
    ({"num_nodes": 12}, "not a multiple of 8"),
    ({"bits": 12}, "bits must be an integer in 1..8"),
    ({"checkpoint_every": 15}, "multiple of config.log_every"),
    ({"machines": 2}, "config.machines=2 needs config.hierarchical=True"),
    ({"hierarchical": True, "machines": -1}, "config.machines=-1 must be an integer >= 1"),
    ({"hierarchical": True, "machines": 2, "num_nodes": 7}, "num_nodes=7 .* not a multiple"),
    ({"hierarchical": True, "machines": 3, "num_nodes": 6}, "machines=3 does not divide the 8"),
    ({"hierarchical": True, "machines": 2, "num_nodes": 16}, "8 workers on each machine's 4"),
    ({"hierarchical": True, "machines": 2, "algorithm": "none"}, "no compressed exchange"),
    ({"hierarchical": True}, "config.hierarchical=True in one process needs config.machines"),
    ({"algorithm": "moniqua", "compressor": "top_k"}, "config.compressor='top_k' would be ignored"),
    ({"divergence_factor": 0.5}, r"config.divergence_factor=0.5 must be > 1"),
    ({"divergence_patience": 0}, r"config.divergence_patience=0 must be a positive integer"),
    ({"eval_local_examples": -1}, r"config.eval_local_examples=-1 must be an integer >= 0"),
    (DILOCO | {"local_steps": 0}, r"config.local_steps=0 must be an integer >= 1"),
    (DILOCO | {"outer_lr": 0.0}, r"config.outer_lr=0.0 must be > 0"),
    (DILOCO | {"outer_momentum": 1.0}, r"config.outer_momentum=1.0 must be in \[0, 1\)"),
    (DILOCO | {"local_steps": 1, "overlap": True}, "config.overlap=True needs config.local_steps"),
    ({"overlap": True}, "config.overlap=True needs config.algorithm='diloco'"),
    (DILOCO | {"outer_warmup_rounds": -2}, "config.outer_warmup_rounds=-2 must be an integer"),
    (DILOCO | {"outer_decay_rounds": -1}, "config.outer_decay_rounds=-1 must be an integer"),
    (DILOCO | {"outer_decay_rounds": 2, "num_steps": 0}, "it needs the run's length in steps"),
    (
        DILOCO
        | {"outer_decay_rounds": 8, "outer_warmup_rounds": 3, "num_steps": 50, "local_steps": 5},
        r"config.outer_warmup_rounds=3 \+ config.outer_decay_rounds=8 exceed the run's 10 rounds",
    ),
    ({"outer_decay_rounds": 3}, "config.outer_decay_rounds=3 needs config.algorithm='diloco'"),
    (DILOCO | {"outer_slow_momentum": 1.0}, r"config.outer_slow_momentum=1.0 must be in \[0, 1\)"),
    (DILOCO | {"outer_slow_weight": 1.5}, r"config.outer_slow_weight=1.5 must be in \[0, 1\]"),
    ({"outer_slow_weight": 0.5}, "config.outer_slow_weight=0.5 needs config.algorithm='diloco'"),
    (DILOCO | {"local_steps": 5, "sync_steps": 12}, "sync_steps=12 must be a multiple of"),
    ({"sync_steps": 10}, "config.sync_steps=10 needs config.algorithm='diloco'"),
    ({"outer_warmup_rounds": 3}, "config.outer_warmup_rounds=3 needs config.algorithm='diloco'"),
    ({"local_steps": 5}, "config.local_steps=5 needs config.algorithm='diloco'"),
    (DILOCO | {"exchange": "allgather"}, "config.exchange='allgather' is not one of"),
    ({"process_sum": "mpi"}, "config.process_sum='mpi' must be one of: auto, jax, host"),
    ({"process_sum": "host"}, "config.process_sum='host' sums over processes of one device"),
    (DILOCO | {"error_feedback": True}, "config.error_feedback=True needs config.exchange="),
    (
        DILOCO | {"exchange": "compressed_mean", "compressor": "modulo"},
        "config.compressor='modulo' cannot serve config.exchange='compressed_mean'",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[str(o) for o, _ in BAD_CONFIGS])
def test_bad_config_values_raise_one_clear_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train.train_and_evaluate(tiny_config(**overrides), str(tmp_path))


def test_the_config_becomes_each_object_once(monkeypatch):
    """setup.build is the one place a config becomes objects: no second topology,
    compressor or algorithm built to validate."""
    calls = []
    for name in ("ring", "minmax", "choco"):
        factory = getattr(lpdec, name)
        monkeypatch.setattr(
            lpdec, name, lambda *a, _f=factory, _n=name, **k: calls.append(_n) or _f(*a, **k)
        )
    experiment = train_lib.build(tiny_config())
    assert sorted(calls) == ["choco", "minmax", "ring"]
    assert experiment.total_steps == 40 and len(experiment.partitions) == 8


REGISTRY_TABLES = [
    ("dataset", registry.DATASETS),
    ("topology", registry.TOPOLOGIES),
    ("compressor", registry.COMPRESSORS),
    ("lr_schedule", optimizers.SCHEDULES),
    ("optimizer", optimizers.OPTIMIZERS),
    ("algorithm", registry.ALGORITHMS),
    ("exchange", registry.EXCHANGES),
]
# cifar10, text_files and token_file need the user's files (tests/test_data.py reads a
# fake CIFAR-10 copy; tests/test_user_data.py builds the other two on files it writes).
USER_FILES = ("cifar10", "text_files", "token_file")
REGISTRY_ENTRIES = [
    (field, name) for field, table in REGISTRY_TABLES for name in table if name not in USER_FILES
]


@pytest.mark.parametrize("field,name", REGISTRY_ENTRIES, ids=[n for _, n in REGISTRY_ENTRIES])
def test_every_registry_entry_declares_the_fields_it_reads(field, name):
    """A factory sees only its declared fields: one it reads but does not declare
    raises AttributeError here (Moniqua's learning_rate, read inside its theta
    schedule, is checked by the theta-schedule run above)."""
    config = tiny_config(theta_follows_lr=True, **{field: name})
    schedule = optax.constant_schedule(0.1)
    built = registry.Built(lpdec.complete(8), lpdec.minmax(), schedule, "nodes", None)
    extra = {
        "lr_schedule": (40,),
        "optimizer": (schedule,),
        "algorithm": (built,),
        "exchange": (built,),
    }.get(field, ())
    if field == "algorithm" and registry.ALGORITHMS[name].role == "whole":
        extra = (built, optax.sgd(0.1), optax.sgd(0.7))
    table = dict(REGISTRY_TABLES)[field]
    built = tables.build(config, field, table, *extra)
    assert (built is None) == (name == "none")


@pytest.mark.parametrize("algorithm", ["choco", "diloco"])
def test_a_build_checks_each_choice_once_and_the_topology_at_the_machine_count(
    monkeypatch, algorithm
):
    """setup.check_values checks every chosen entry; setup.build builds them without
    checking again, except the topology, which it checks at the gossip nodes the
    layout gives (2 machines of a hierarchical run, not the 8 workers)."""
    calls: dict[str, list] = {}
    config = tiny_config(
        algorithm=algorithm, hierarchical=True, machines=2, topology="ring", precision="fp32"
    )
    if algorithm == "diloco":
        config.update(local_steps=5, exchange="compressed_mean", error_feedback=True)
    for field, table in REGISTRY_TABLES:
        entry = table[config[field]]

        def check(view, entry=entry, field=field):
            calls.setdefault(field, []).append(getattr(view, "num_nodes", None))
            if entry.check is not None:
                entry.check(view)

        fields = entry.check_fields + (("num_nodes",) if field == "topology" else ())
        replaced = dataclasses.replace(entry, check=check, check_fields=fields)
        monkeypatch.setitem(table, config[field], replaced)
    setup.build(config)
    once = {"dataset", "topology", "compressor", "lr_schedule", "optimizer", "algorithm"}
    assert {field: len(seen) for field, seen in calls.items()} == dict.fromkeys(
        once | ({"exchange"} if algorithm == "diloco" else set()), 1
    )
    assert calls["topology"] == [2]


def _env(devices):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def _python(*args) -> subprocess.CompletedProcess:
    """`python *args` in the repository root on 8 devices, its output captured as text."""
    return subprocess.run(
        [sys.executable, *args], env=_env(8), capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_command_line_reports_a_bad_config_in_one_line(tmp_path):
    proc = _python(
        str(ROOT / "train.py"),
        f"--config={ROOT / 'configs' / 'quickstart.py'}",
        f"--workdir={tmp_path}",
        "--config.algorithm=gossip",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config.algorithm='gossip' is not one of"), last
    assert "Traceback" not in proc.stderr


def test_the_command_line_imports_no_jax_before_training_starts():
    """The flags, the multi-process handshake and an elastic machine's supervisor run
    before jax is imported (a refused start costs no jax import): importing train.py,
    its command line and the handshake's modules leaves jax, flax, orbax and lpdec out."""
    heavy = ("jax", "flax", "optax", "orbax", "lpdec")
    proc = _python(
        "-c",
        "import sys, train; from train_lib import cli, processes, watchdog, workdir\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def _two_processes(workdir, flags, devices=4):
    """train.py as 2 jax.distributed processes of `devices` CPU devices (gloo, loopback)."""
    base = [sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'default.py'}"]
    address = f"127.0.0.1:{harness.free_port()}"
    procs = [
        subprocess.Popen(
            base
            + [
                f"--workdir={workdir}",
                f"--coordinator_address={address}",
                "--num_processes=2",
                f"--process_id={i}",
            ]
            + flags,
            env=_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]


# 2 machines of 4 workers in fp32 with the identity compressor, on TINY_FLAGS' data and
# model (the MLP's default widths) and 20 steps: the one-process runs that the multi-process
# runs of the same flags (hierarchical_flags) are compared with, and the replicated twins of
# tests/test_train_sharded.py's sharded runs.
HIERARCHICAL = dict(
    hierarchical=True, machines=2, precision="fp32", compressor="identity", num_steps=20
)


def hierarchical_config(**overrides):
    """tiny_config with HIERARCHICAL, the MLP's default widths and `overrides`."""
    config = tiny_config(**HIERARCHICAL)
    config.model_kwargs = ml_collections.ConfigDict()  # the MLP's defaults, as TINY_FLAGS
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def hierarchical_run(shared_run, **overrides):
    """hierarchical_config(**overrides) trained in this process, once per test run for
    every test that names the same overrides (conftest.shared_run): (workdir, summary)."""
    name = "hierarchical" + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    config = hierarchical_config(**overrides)
    return shared_run(name, lambda d: train.train_and_evaluate(config, str(d)))


def hierarchical_flags(**overrides):
    """train.py's flags for hierarchical_config(**overrides) (overrides of plain values) in
    a run of 2 processes: config.machines left at 0, the processes are the machines."""
    fields = {k: v for k, v in {**HIERARCHICAL, **overrides}.items() if k != "machines"}
    kept = [f for f in TINY_FLAGS if f.split("=")[0].removeprefix("--config.") not in fields]
    return kept + [f"--config.{key}={value}" for key, value in fields.items()]


HIERARCHICAL_ALGORITHMS = {
    # The fp32 mean over (machines, workers): reduce-scatter, sum between, all-gather.
    "allreduce": dict(algorithm="allreduce"),
    "choco": dict(algorithm="choco"),
    "compressed_mean": dict(algorithm="compressed_mean"),
    # 20 steps = 4 rounds of 5: every node ends on the synchronised anchor.
    "diloco-gossip": dict(algorithm="diloco", local_steps=5, exchange="gossip"),
}


@pytest.mark.parametrize("algorithm", sorted(HIERARCHICAL_ALGORITHMS))
def test_hierarchical_run_on_two_processes_matches_two_simulated_machines(
    tmp_path, shared_run, algorithm
):
    """Processes as machines: 2 processes x 4 devices run hierarchical CHOCO (gradients
    averaged inside a process, CHOCO between the processes on a 1/4 slice per device),
    seed 004's compressed mean or DiLoCo gossiping between the machines, and land where
    1 process simulating 2 machines x 4 workers lands (the one-process runs of choco and
    compressed_mean are tests/test_train_sharded.py's replicated runs too).

    Not bit for bit: the in-machine all-reduce of the gradients adds in another order
    under gloo than in one process; measured 4.5e-7 at most after 20 steps, float32
    rounding of parameters near 1. Hence the identity compressor: with 8 bits, some of
    those ulps flip a code and the runs drift apart by code steps (2e-4 here), which
    would hide a real mismatch; the per-slice 8-bit rule is checked exactly against
    numpy in tests/test_hierarchy.py."""
    overrides = HIERARCHICAL_ALGORITHMS[algorithm]
    single, _ = hierarchical_run(shared_run, **overrides)
    multi = tmp_path / "multi"
    _two_processes(multi, hierarchical_flags(**overrides))
    summary = json.loads((multi / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 8
    a, b = final_params(single), final_params(multi)
    # Every worker of a machine holds the machine's model, bit for bit (DiLoCo's workers
    # average their gradients in the local steps too). DiLoCo's outer Nesterov step (lr
    # 0.7, momentum 0.9) amplifies the gradients' other rounding: 4.5e-6 measured.
    atol = 1e-5 if overrides["algorithm"] == "diloco" else 2e-6
    for name in a:
        for params in (a[name], b[name]):
            for machine in (params[:4], params[4:]):
                np.testing.assert_array_equal(machine, machine[:1].repeat(4, axis=0), name)
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=atol, err_msg=name)


def test_hierarchical_chain_averages_each_machines_gradients_first(rng):
    """config.hierarchical=True: a machine's step depends only on the mean of its
    workers' gradients (shard_over alone would keep the workers in step even without
    that mean, each contributing its own slice of its own gradient)."""
    experiment = train_lib.build(tiny_config(hierarchical=True, machines=2, weight_decay=0.0))
    layout, tx = experiment.layout, experiment.tx
    assert experiment.topology.num_nodes == 2 and layout.machines == 2
    # Multiples of 1/8: the means are exact in any summation order, so 8-bit codes match.
    grads = (rng.integers(-16, 17, size=(8, 5)) / 8).astype(np.float32)
    means = grads.reshape(2, 4, 5).mean(axis=1).repeat(4, axis=0)

    def step(params, opt_state, g):
        updates, _ = tx.update(g, opt_state, params)
        return updates

    params, opt_state = lpdec.init_nodes(tx, {"w": np.ones(5, np.float32)}, layout)
    step = jax.jit(layout.map(step, (True, True, True)))
    got = step(params, opt_state, {"w": layout.put(grads)})["w"]
    expected = step(params, opt_state, {"w": layout.put(means)})["w"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_moniqua_theta_warnings_reach_the_metrics(tmp_path):
    """A θ far below the models' spread shows in metrics.csv and summary.json; a generous
    one shows nothing (Health.theta_warnings, issue 14 point 10)."""
    common = dict(algorithm="moniqua", compressor="modulo", num_steps=20, checkpoint_every=0)
    tight = train.train_and_evaluate(tiny_config(theta=1e-3, **common), str(tmp_path / "tight"))
    # Generous, not absurd: this int8 MLP's nodes wrap below theta ~ 10 (warnings at 1, 4,
    # 7; at 20, 4 warnings with jax 0.12 and numpy 2.5, none with jax 0.10), and theta = 50
    # makes the 8-bit decode error diverge the run (30 and 40: none, finite, on both).
    loose = train.train_and_evaluate(tiny_config(theta=30.0, **common), str(tmp_path / "loose"))
    assert math.isfinite(loose["final"]["train_loss"])
    assert tight["final"]["theta_warnings"] > 0
    assert loose["final"]["theta_warnings"] == 0
    with open(tmp_path / "tight" / "metrics.csv") as f:
        assert int(list(csv.DictReader(f))[-1]["theta_warnings"]) > 0
