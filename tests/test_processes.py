"""Multi-process starts that cannot work end every process with one line, quickly
(issue 14, point 6): a config or --num_processes that differs, the same --process_id
twice, an id out of range, a peer that never comes, per-machine workdirs, config.devices."""

import csv
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from test_train import TINY_FLAGS
from test_train import _env
from test_train import final_params

from bench.harness import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train_lib import processes  # noqa: E402

TRAIN = [sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs' / 'default.py'}"]


def _start(tmp_path, per_process, timeout=60):
    """Starts one train.py per entry of `per_process` (its own flags); returns (codes,
    last stderr lines, seconds)."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            TRAIN
            + [f"--workdir={tmp_path / 'w'}", f"--coordinator_address={address}"]
            + TINY_FLAGS
            + flags,
            env=_env(4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
        for flags in per_process
    ]
    errors = []
    for proc in procs:
        try:
            errors.append(proc.communicate(timeout=timeout + 60)[1])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a process was still running after {timeout + 60} s")
    lasts = [e.strip().splitlines()[-1] if e.strip() else "" for e in errors]
    return [p.returncode for p in procs], lasts, time.monotonic() - started


TWO = [["--num_processes=2", "--process_id=0"], ["--num_processes=2", "--process_id=1"]]

MISMATCHES = [
    (
        [TWO[0], TWO[1] + ["--config.algorithm=dcd"]],
        "config.algorithm (process 0: 'choco', process 1: 'dcd')",
        [0, 1],
    ),
    (
        [TWO[0], ["--num_processes=3", "--process_id=1"]],
        "--num_processes differs (process 0: 2, process 1: 3)",
        [0, 1],
    ),
    ([TWO[0], TWO[0]], "", [0, 1]),  # the same id twice: see the test
    (
        [TWO[0] + ["--peer_timeout=15"], ["--num_processes=2", "--process_id=2"]],
        "--process_id=2 must be in 0..1",
        [1],
    ),
    # Process 0 waits for a host-sum connection that process 1 never opens: it must
    # name the difference at once, not wait out the --peer_timeout (300 s).
    (
        [TWO[0] + ["--config.process_sum=host"], TWO[1] + ["--config.process_sum=jax"]],
        "config.process_sum (process 0: 'host', process 1: 'jax')",
        [0, 1],
    ),
]


@pytest.mark.parametrize(
    "flags,message,who",
    MISMATCHES,
    ids=["config", "num_processes", "same-id", "id-out-of-range", "host-sum-on-one-side"],
)
def test_processes_that_do_not_fit_together_all_stop_with_one_line(tmp_path, flags, message, who):
    codes, lasts, seconds = _start(tmp_path, flags)
    assert codes == [2, 2], (codes, lasts)
    for i in who:
        assert lasts[i].startswith("error: ") and message in lasts[i], lasts
    if message == "":
        # Process 0 is started twice: one serves the handshake, the other finds the
        # port taken or is refused as a second --process_id=0; both end with one line.
        assert all(last.startswith("error: ") for last in lasts), lasts
    if "out of range" not in str(flags):
        assert seconds < 50, seconds


def test_a_peer_that_never_comes_is_given_up_after_the_timeout(tmp_path):
    codes, lasts, seconds = _start(tmp_path, [TWO[0] + ["--peer_timeout=5"]])
    assert codes == [2], lasts
    assert "process(es) 1 of 2 did not connect" in lasts[0], lasts
    assert seconds < 40, seconds


def test_per_machine_workdirs_are_refused_at_start(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            TRAIN
            + [f"--workdir={tmp_path / f'machine{i}'}", f"--coordinator_address={address}"]
            + TINY_FLAGS
            + TWO[i],
            env=_env(4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], errors
    last = errors[1].strip().splitlines()[-1]
    assert "is not one directory shared by all processes: process(es) 1" in last, last
    assert not list(tmp_path.glob("machine*/checkpoints/*"))


def test_host_sum_with_several_devices_a_process_is_refused_before_training(tmp_path):
    codes, lasts, _ = _start(tmp_path, [f + ["--config.process_sum=host"] for f in TWO])
    assert codes == [2, 2], lasts
    assert "config.process_sum='host' sums over processes of one device" in lasts[0], lasts


def test_config_devices_below_the_device_count_is_refused_in_a_multi_process_run(tmp_path):
    codes, lasts, _ = _start(tmp_path, [f + ["--config.devices=2"] for f in TWO])
    assert codes == [2, 2], lasts
    assert "config.devices=2 in a run of 2 processes" in lasts[0], lasts


def test_fewer_nodes_than_devices_is_refused_in_a_multi_process_run(tmp_path):
    """One node over 2 processes (quickstart_central's num_nodes): process 1 would hold no
    node; both stop with one line instead of a crash on one and a hang on the other."""
    codes, lasts, _ = _start(tmp_path, [f + ["--config.num_nodes=1"] for f in TWO])
    assert codes == [2, 2], lasts
    assert "config.num_nodes=1 is below the 8 devices" in lasts[0], lasts


@pytest.mark.parametrize(
    "address,override,expected",
    [
        ("127.0.0.1:1234", None, "127.0.0.1:1234"),
        ("localhost:99", None, "127.0.0.1:99"),
        ("[::1]:5", None, "[::1]:5"),
        ("10.1.2.3:7", "0.0.0.0:7", "0.0.0.0:7"),
    ],
)
def test_the_coordinator_binds_to_the_address_peers_dial(address, override, expected):
    assert processes.bind_address(address, override) == expected


@pytest.mark.parametrize(
    "args,message",
    [
        (("h:1", 2, 2), "--process_id=2 must be in 0..1"),
        (("h:1", 0, 0), "--num_processes=0 must be an integer >= 1"),
        (("nohost", 2, 0), "must be HOST:PORT"),
        ((None, 2, 1), "need --coordinator_address"),
    ],
)
def test_bad_multi_process_flags_are_one_line(args, message):
    with pytest.raises(processes.ProcessError, match=message):
        processes.check_args(*args)


# XLA:CPU gives each process an intra-op thread pool of max(NPROC, else the schedulable
# cores; the process's devices) threads, and Eigen's matmuls and convolutions choose from
# that size how to block and split their sums: 2 processes of 4 forced devices (4 threads
# each on a small machine) round differently from 1 process of 8 (8 threads). NPROC=8 in
# both gives every process 8 threads, as on a machine of 8 or more cores.
SAME_THREADS = {"NPROC": "8"}


# quickstart: the 1-D CNN in 8 bits (convolutions, 8-bit layers, their noise keys per node)
# with 8-bit CHOCO; link_mlp: an fp32 MLP of 1.09M parameters (matmuls). default (the
# 1-D CNN in fp32 with 8-bit CHOCO, a subset of quickstart's paths) was dropped from the
# grid for CI's time (55 s of 2 cores).
@pytest.mark.parametrize("config", ["quickstart", "link_mlp"])
def test_two_processes_of_four_devices_match_one_of_eight_bit_for_bit(tmp_path, config):
    """A shipped config (its model, precision, algorithm and compressor; 4 steps in 2
    logged chunks, a checkpoint after each) ends with the same parameters and logs the
    same metrics, bit for bit, whether 8 nodes run in 1 process of 8 devices or in 2
    processes of 4 (jax.distributed over loopback, gloo CPU collectives). On a fifth of
    the config's data (2,000 sequences): the programs are the config's, each of the 3
    processes makes and evaluates less."""
    flags = [
        f"--config={ROOT / 'configs' / f'{config}.py'}",
        "--config.num_samples=2000",
        "--config.num_steps=4",
        "--config.log_every=2",
        "--config.checkpoint_every=2",
        "--config.save_final_params=True",
    ]
    train = [sys.executable, str(ROOT / "train.py")]
    subprocess.run(
        train + flags + [f"--workdir={tmp_path / 'single'}"],
        env={**_env(8), **SAME_THREADS},
        check=True,
        capture_output=True,
        cwd=ROOT,
        timeout=600,
    )
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            train
            + flags
            + [
                f"--workdir={tmp_path / 'multi'}",
                f"--coordinator_address={address}",
                "--num_processes=2",
                f"--process_id={i}",
            ],
            env={**_env(4), **SAME_THREADS},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        errors = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors[0][-3000:] + errors[1][-3000:]

    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 8
    # The checkpoint between the chunks, saved while the next one runs, and the last.
    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["2", "4"]
    single, multi = (final_params(tmp_path / w) for w in ("single", "multi"))
    assert sorted(single) == sorted(multi)
    for name in single:
        np.testing.assert_array_equal(multi[name], single[name], err_msg=name)
    # Every logged value but the times, e.g. the consensus distance and the
    # node-averaged model's test accuracy, which reduce over all nodes.
    rows = []
    for workdir in ("single", "multi"):
        with open(tmp_path / workdir / "metrics.csv") as f:
            rows.append(list(csv.DictReader(f)))
    assert len(rows[0]) == 2
    for a, b in zip(*rows, strict=True):
        for timing in ("step_time_s", "eval_time_s", "wall_time_s"):
            del a[timing], b[timing]
        assert a == b
